"""A NaN or infinity in a training step: "stop" names the step and the first stage on every rank,
"skip" drops that optimizer step on every rank, "ignore" trains on."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.runtime.update.nonfinite import NonFiniteWatch, all_finite, first_nonfinite
from tests.harness import run_ranks
from tests.models import mlp


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


def exp_net() -> nn.Module:
    """Linear | Exp, Linear: a huge input stays finite on stage 0 and overflows on stage 1."""
    return nn.Sequential(nn.Linear(8, 16), Exp(), nn.Linear(16, 4))


def batches(bad_step=None, bad=float("nan"), n=4):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(1, n + 1):
        x, y = torch.randn(6, 8, generator=g) * 0.3, torch.randint(0, 4, (6,), generator=g)
        if step == bad_step:
            x[2, 3] = bad
        out.append((x, y))
    return out


def run(rank, world, net_fn, layers, on_nonfinite, data, dp=1, loss=None):
    torch.manual_seed(0)
    net = net_fn()
    initial = copy.deepcopy(net.state_dict())
    config = plait.Config(num_microbatches=2, layers_per_stage=layers, dp=dp, on_nonfinite=on_nonfinite)
    model = plait.Model(net, config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=loss or nn.CrossEntropyLoss())
    losses = []
    try:
        for x, y in data:
            losses.append(model.train_on_batch(x, y))
    except plait.NonFiniteError as e:
        return "error", str(e), model.state_dict(), model.step, initial
    return "done", losses, model.state_dict(), model.step, initial


def reference(net_fn, initial, data, skip=()):
    net = net_fn()
    net.load_state_dict(initial)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data, start=1):
        if step in skip:
            continue
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return net.state_dict()


def close(state, want):
    for k in want:
        torch.testing.assert_close(state[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(120)
def test_stop_names_the_step_and_the_first_stage_on_every_rank_before_the_update():
    data = batches(bad_step=3)
    for kind, message, state, step, initial in run_ranks(2, run, mlp, [5, 6], "stop", data, timeout=110):
        assert kind == "error" and step == 2
        assert message.startswith("step 3: a NaN or infinite value first appeared in the output of stage 0 (rank 0)")
        assert "parameters are those after step 2" in message and "on_nonfinite='skip'" in message
        close(state, reference(mlp, initial, data[:2]))


@pytest.mark.timeout(120)
def test_an_overflow_on_the_second_stage_is_placed_there():
    data = batches(bad_step=2, bad=1e4)
    for kind, message, _, step, _ in run_ranks(2, run, exp_net, [1, 2], "stop", data, timeout=110):
        assert kind == "error" and step == 1
        assert "step 2: a NaN or infinite value first appeared in the output of stage 1 (rank 1)" in message


def inf_loss(out, y):
    loss = F.cross_entropy(out, y)
    return loss * float("inf") if y[0] == 3 else loss


def test_a_loss_that_alone_becomes_infinite_is_named():
    data = batches()
    first = next(i for i, (_, y) in enumerate(data, start=1) if y[0] == 3)
    kind, message, _, step, _ = run(0, 1, mlp, None, "stop", data, loss=inf_loss)
    assert kind == "error" and step == first - 1
    assert f"step {first}: a NaN or infinite value first appeared in the loss" in message


@pytest.mark.timeout(120)
def test_skip_drops_that_step_on_every_replica_and_trains_on():
    data = batches(bad_step=2)
    results = run_ranks(2, run, mlp, None, "skip", data, 2, timeout=110)  # dp=2: the NaN is on replica 0
    for kind, losses, state, step, initial in results:
        assert kind == "done" and step == 4
        assert [loss != loss for loss in losses] == [False, True, False, False]  # the NaN is reported
        close(state, reference(mlp, initial, data, skip={2}))


def test_ignore_does_not_check():
    kind, losses, state, step, _ = run(0, 1, mlp, None, "ignore", batches(bad_step=2))
    assert kind == "done" and step == 4
    assert all(v != v for v in losses[1:])  # NaN from step 2 on: the parameters took it
    assert all(torch.isnan(v).any() for v in state.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64])
def test_all_finite_finds_one_bad_element_anywhere(dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 96, 8, 8, generator=g).to(dtype)
    assert all_finite(t) and all_finite(t[:, ::3].transpose(1, 3)) and all_finite(t[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for index in (0, 4097, t.numel() - 1):
            u = t.clone()
            u.view(-1)[index] = bad
            assert not all_finite(u), (bad, index)
            assert not all_finite(u.transpose(0, 3)), (bad, index)  # not contiguous
    if not dtype.is_complex:
        wide = torch.zeros(8, dtype=dtype)
        wide[0], wide[1] = torch.finfo(dtype).max, torch.finfo(dtype).min
        assert all_finite(wide)  # a range wider than the type's: still finite


class Outputs(nn.Module):
    """Returns the next of `values` at each call (a float32 and a float16 tensor, and an int one)."""

    def __init__(self, values):
        super().__init__()
        self.values = list(values)

    def forward(self, x):
        return self.values.pop(0)


def watched(stages):
    pipe = SimpleNamespace(plan=SimpleNamespace(num_chunks=len(stages)),
                           executors={s: SimpleNamespace(stage=SimpleNamespace(module=m)) for s, m in enumerate(stages)})
    return NonFiniteWatch(pipe)


def test_watch_flags_the_stage_whose_later_microbatch_went_bad_and_forgets_it_next_step():
    ok = (torch.ones(3), torch.ones(2, dtype=torch.float16), torch.tensor([7]))
    bad = (torch.ones(3), torch.tensor([1.0, float("inf")], dtype=torch.float16), torch.tensor([7]))
    first, second = Outputs([ok, ok, ok, ok]), Outputs([ok, bad, ok, ok])
    watch = watched([first, second])
    x = torch.zeros(1)
    watch.start()
    for _ in range(2):  # two micro-batches through both stages: stage 1's second output is bad
        first(x), second(x)
    assert watch.finish({0: 0.5, 1: 0.25}) == [0.0, 1.0, 0.0]
    watch.start()
    for _ in range(2):
        first(x), second(x)
    assert watch.finish({0: float("nan"), 1: 0.25}) == [0.0, 0.0, 1.0]  # the loss alone this time
    watch.remove()
    assert not first._forward_hooks and not second._forward_hooks


def test_first_nonfinite():
    assert first_nonfinite([0.0, 0.0, 0.0]) is None
    assert first_nonfinite([0.0, 2.0, 1.0]) == 1
    assert first_nonfinite([0.0, 0.0, 1.0]) == 2  # num_stages: the loss alone


def test_fit_with_skip_keeps_nan_out_of_the_epoch_loss():
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    x[5, 0] = float("nan")
    y = torch.randint(0, 4, (12,), generator=torch.Generator().manual_seed(2))
    model = plait.Model(mlp(), plait.Config(on_nonfinite="skip"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=nn.CrossEntropyLoss())
    history = model.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0)
    assert model.step == 6 and all(v == v for v in history.history["loss"])
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
