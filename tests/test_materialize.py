"""Parameters a rank freed come back when a state dict is loaded into the module (`release_parameters`).

After `fit` on 2 ranks each rank frees the parameters of the stages it does not run. The README's
example then loaded `model.state_dict()` into that module to sample from it, and torch copied
nothing into the freed (meta) parameters ("copying ... to a meta parameter ... is a no-op"): the
forward failed with "Tensor on device meta is not on the expected device cpu". Now the load brings
them back, ties kept, so the module is whole on every rank and computes what one process does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import plait
from plait.materialize import on_meta, release_parameters
from tests.harness import run_ranks
from tests.models import LAYERS, even_cut, make, mlp


class Tied(nn.Module):
    """An embedding and a head sharing one weight, the head's module holding it under another name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.mark.timeout(10)
def test_a_loaded_state_brings_freed_parameters_back_and_keeps_ties():
    torch.manual_seed(0)
    net = Tied()
    state = copy.deepcopy(net.state_dict())
    assert release_parameters(net, keep=[]) == 1
    assert net.head.weight.is_meta and net.head.weight is net.embed.weight
    net.load_state_dict(state)
    assert not on_meta(net) and net.head.weight is net.embed.weight
    torch.testing.assert_close(net.embed.weight, state["embed.weight"], rtol=0, atol=0)


@pytest.mark.timeout(10)
def test_a_submodule_load_brings_back_its_own_and_leaves_what_the_state_lacks():
    net = mlp()
    kept = list(net[0].parameters())
    release_parameters(net, keep=kept)
    net[2].load_state_dict(mlp()[2].state_dict())
    assert not any(p.is_meta for p in net[2].parameters())
    assert net[4].weight.is_meta  # not in the state loaded: still freed
    assert all(p is q for p, q in zip(net[0].parameters(), kept))


def fit_then_load(rank, world):
    torch.manual_seed(0)
    net, x, y, loss = make("gpt")
    model = plait.Model(net, plait.Config(layers_per_stage=even_cut(LAYERS["gpt"], 2), num_microbatches=2),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=loss)
    model.fit(x, y, epochs=1, batch_size=len(x) // 2, verbose=0)
    freed = on_meta(net)
    net.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = net(x).logits
    want = model.predict(x)
    return freed, on_meta(net), (out - want.logits).abs().max().item()


@pytest.mark.timeout(120)
def test_after_fit_on_two_ranks_net_load_state_dict_makes_the_module_whole_on_every_rank():
    for freed, still_meta, difference in run_ranks(2, fit_then_load, timeout=110):
        assert freed and not still_meta
        assert difference < 1e-5
