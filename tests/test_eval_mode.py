"""evaluate and predict run the model in eval mode, on a pipeline too, and leave its train/eval flags as they were.

A model with dropout 0.5 on both sides of a 2-stage cut: in train mode every call draws other
masks, so outputs that repeat and equal one process's `net.eval()` outputs show that both
stages ran in eval mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from tests.harness import run_ranks

CUT = (3, 4)  # the dropout after layer 1 on stage 0, the one after layer 4 on stage 1


def dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 16), nn.Tanh(),
                         nn.Dropout(0.5), nn.Linear(16, 4))


def data(n: int = 23, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def flags(net: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in net.named_modules()}


def predict_and_evaluate(rank: int, world: int) -> dict:
    x, y = data()
    net = dropout_mlp()
    model = plait.Model(net, plait.Config(layers_per_stage=CUT, num_microbatches=2),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    model.fit(x, y, epochs=1, batch_size=10, shuffle=False, verbose=0)  # trains in train mode
    out: dict = {"after_fit": flags(net)}

    net.train()
    first = model.predict(x, batch_size=7)  # 23 rows: batches of 7, 7, 7, 2
    second = model.predict(x, batch_size=7)
    out["after_predict_in_train_mode"] = flags(net)
    result = model.evaluate(x, y, batch_size=7)
    out["after_evaluate_in_train_mode"] = flags(net)
    net.eval()
    third = model.predict(x, batch_size=5)
    result_eval = model.evaluate(x, y, batch_size=5)
    out["after_predict_in_eval_mode"] = flags(net)

    ref = dropout_mlp()  # one process, the parameters plait trained, in eval mode
    ref.load_state_dict(model.state_dict())
    ref.eval()
    with torch.no_grad():
        want = ref(x)
    out.update(first=first, second=second, third=third, want=want, loss=result["loss"],
               loss_eval=result_eval["loss"], want_loss=float(F.cross_entropy(want, y)))
    with torch.no_grad():
        ref.train()
        out["train_mode_differs"] = not torch.allclose(ref(x), want)  # the dropout is real
    return out


@pytest.mark.timeout(120)
def test_predict_and_evaluate_run_in_eval_mode_on_two_stages_and_restore_the_flags():
    for rank, got in enumerate(run_ranks(2, predict_and_evaluate, timeout=110)):
        assert got["train_mode_differs"], "dropout 0.5 changed nothing: the test would not see train mode"
        assert torch.equal(got["first"], got["second"]), f"rank {rank}: two predicts differ"
        torch.testing.assert_close(got["first"], got["want"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["third"], got["want"], rtol=1e-5, atol=1e-6)
        assert got["loss"] == pytest.approx(got["want_loss"], rel=1e-5), rank
        assert got["loss_eval"] == pytest.approx(got["want_loss"], rel=1e-5), rank
        assert all(got["after_fit"].values()), got["after_fit"]
        assert all(got["after_predict_in_train_mode"].values()), got["after_predict_in_train_mode"]
        assert all(got["after_evaluate_in_train_mode"].values()), got["after_evaluate_in_train_mode"]
        assert not any(got["after_predict_in_eval_mode"].values()), got["after_predict_in_eval_mode"]


def test_a_submodule_left_in_eval_mode_stays_so_after_train_predict_and_evaluate():
    """A module the user put in eval mode in a training model (a frozen dropout or batch norm)
    is in eval mode again after each call, on one process."""
    x, y = data()
    net = dropout_mlp()
    net.train()
    net[2].eval()
    before = flags(net)
    model = plait.Model(net, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    for call in (lambda: model.train_on_batch(x, y), lambda: model.predict(x, batch_size=10),
                 lambda: model.evaluate(x, y, batch_size=10)):
        call()
        assert flags(net) == before


def train_with_frozen_dropouts(rank: int, world: int) -> dict:
    x, y = data()
    net = dropout_mlp()
    net.train()
    net[2].eval(), net[5].eval()  # frozen: a training model whose dropouts the user switched off
    model = plait.Model(net, plait.Config(layers_per_stage=CUT, num_microbatches=2),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    losses = [model.train_on_batch(x, y) for _ in range(2)]
    return {"losses": losses, "state": model.state_dict(), "flags": flags(net)}


@pytest.mark.timeout(120)
def test_a_submodule_frozen_in_eval_mode_trains_as_in_one_process():
    # The story: each step set net.train(True), so a dropout the user had frozen dropped units
    # again on the pipeline (and stayed switched on after it).
    x, y = data()
    ref = dropout_mlp()
    ref.train()
    ref[2].eval(), ref[5].eval()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    for got in run_ranks(2, train_with_frozen_dropouts, timeout=110):
        assert got["losses"] == pytest.approx(want, rel=1e-5)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6)
        assert got["flags"] == flags(ref)
