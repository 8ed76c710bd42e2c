"""Layer reuse: a module called at every depth is cut between its calls and trains as in one process.

`Looped` is a universal-transformer-style loop (ALBERT's shape): an embedding, ONE block called
four times, a head. Each call is its own layer (block, block#1, ...); cut between calls, every
stage that calls the block holds its weights, tied: their gradients are summed over those stages
(and replicas). Compared with one process after 3 SGD-with-momentum steps: losses, every
parameter, `state_dict()` holding the block once, and the plan naming the tie.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait.capture.trace import capture_batch
from tests.alongside import state_problems, train_alongside
from tests.harness import run_ranks

CALLS = 4


class Looped(nn.Module):
    """emb -> block x CALLS (the same weights each time) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.block, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 6)
        h = self.emb(x)
        for _ in range(CALLS):
            h = torch.tanh(self.block(h)) + h  # (B, 8)
        return self.head(h)  # (B, 3)


def test_each_call_is_a_layer_and_every_cut_is_allowed() -> None:
    layers = capture_batch(Looped(), torch.randn(2, 6)).layers
    assert layers.layer_names == ("emb", "block", "block#1", "block#2", "block#3", "head")
    assert layers.uncuttable == ()


def train_and_compare(rank: int, world: int, cut: tuple[int, ...]) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Looped()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    model = plait.Model(net, plait.Config(layers_per_stage=cut, dp=world // len(cut), num_microbatches=2,
                                          timeout_s=30.0),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss=loss_fn)
    problems = train_alongside(model, ref, ref_opt, loss_fn, [(x[a:a + 4], y[a:a + 4]) for a in (0, 4, 8)])
    state, want = model.state_dict(), ref.state_dict()
    if list(state) != list(want):
        problems.append(f"state_dict keys {list(state)} != {list(want)}")
    problems += state_problems(state, want)
    for name, p in net.named_parameters():  # this rank's copy of a tied weight is the trained one too
        if p.grad is not None:
            try:
                torch.testing.assert_close(p.detach(), want[name], rtol=1e-5, atol=1e-6)
            except AssertionError as e:
                problems.append(f"rank {rank}'s {name}: {str(e).splitlines()[0]}")
    return {"problems": problems, "tied": dict(model.plan.tied_parameters)}


@pytest.mark.parametrize("world, cut, tied_stages", [
    (2, (3, 3), (0, 1)),  # block, block#1 on stage 0; block#2, block#3 on stage 1
    (3, (2, 2, 2), (0, 1, 2)),  # the block on every stage
    (4, (2, 4), (0, 1)),  # 2 stages x 2 replicas: the tie's sum spans stages and replicas
])
@pytest.mark.timeout(200)
def test_cut_between_calls_trains_equal_to_one_process(world: int, cut: tuple[int, ...],
                                                       tied_stages: tuple[int, ...]) -> None:
    for report in run_ranks(world, train_and_compare, cut, timeout=180):
        assert not report["problems"], "\n".join(report["problems"])
        assert report["tied"] == {"block.weight": tied_stages, "block.bias": tied_stages}
