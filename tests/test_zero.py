"""ZeRO-1 and 2: each stage's optimizer state (2: and gradients) sharded over its replicas, training
equal to one process.

Each replica steps only its share of the stage's parameters (whole ones) and keeps only that
share's optimizer state, then the owners broadcast their updated parameters. Checked against one
process: losses and every parameter after 3 steps with batches of 7 rows (not divisible by dp),
under Adam (eps=1e-3, as in test_equivalence) and SGD with momentum; the optimizer state on each
rank is its share only (disjoint across replicas, covering the stage), tied weights excepted
(every holder steps them). At zero=2 each bucket is reduced to its owners and a rank ends the
step holding gradients of its share only. A zero=1 checkpoint resumes bitwise on the same layout, and at zero=0
and in one process within fp32 rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import plait
from plait.runtime.dp.zero import share_out, zero_owners
from plait.tensor_parts import TpShard
from tests.harness import run_ranks
from tests.models import LAYERS, even_cut, make

ROWS = 7  # each global batch: 7 rows, split 4 + 3 over 2 replicas


def _optimizer(kind: str):
    if kind == "adam":
        return lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-3)
    return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _model(name: str, stages: int, dp: int, zero: int, kind: str, net: Any = None,
           **fields: Any) -> tuple[plait.Model, Any]:
    net = net if net is not None else make(name)[0]
    loss = make(name)[3]
    config = plait.Config(**{"layers_per_stage": even_cut(LAYERS[name], stages), "dp": dp, "zero": zero,
                             "num_microbatches": 2, "timeout_s": 30.0, **fields})
    return plait.Model(net, config, optimizer=_optimizer(kind), loss=loss), net


def _reference(name: str, kind: str, steps: int, rows: int = ROWS) -> tuple[list[float], dict[str, torch.Tensor]]:
    net, x, y, loss_fn = make(name)
    opt = _optimizer(kind)(net.parameters())
    losses = []
    for a in range(0, steps * rows, rows):
        opt.zero_grad()
        loss = loss_fn(net(x[a:a + rows]), y[a:a + rows])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, net.state_dict()


def train_and_compare(rank: int, world: int, name: str, stages: int, kind: str, zero: int, rows: int = ROWS,
                      fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """3 steps of `rows` rows against one process; `fields`: more Config fields."""
    _, x, y, _ = make(name)
    model, net = _model(name, stages, world // stages, zero, kind, **(fields or {}))
    want_losses, want_state = _reference(name, kind, 3, rows)
    problems = []
    for step, a in enumerate(range(0, 3 * rows, rows)):
        got = model.train_on_batch(x[a:a + rows], y[a:a + rows])
        if abs(got - want_losses[step]) > 1e-5 * abs(want_losses[step]) + 1e-6:
            problems.append(f"loss of step {step}: {got} != {want_losses[step]}")
    state = model.state_dict()
    for key, value in want_state.items():
        try:
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            problems.append(f"{key}: {str(e).splitlines()[0]}")
    for pname, p in net.named_parameters():  # every replica holds the updated values, not only the owner
        if any(p is q for q in model._train.pipe.local_parameters):  # type: ignore[union-attr]
            if not torch.equal(p.detach(), state[pname]):
                problems.append(f"rank {rank}'s {pname} is not the trained value")
    assert model.optimizer is not None
    names = {id(p): n for n, p in net.named_parameters()}
    pipe = model._train.pipe  # type: ignore[union-attr]
    return {"problems": problems, "state": sorted(names[id(p)] for p in model.optimizer.state),
            "grads": sorted(names[id(p)] for p in pipe.local_parameters if p.grad is not None),
            "held": pipe.sync.held_bytes if pipe.sync else 0, "stage_bytes": sum(p.numel() * 4 for p in pipe.local_parameters),
            "local": sorted(names[id(p)] for p in model._train.pipe.local_parameters),  # type: ignore[union-attr]
            "tied": [n for n, _ in model.plan.tied_parameters], "zero": model.plan.zero}


def test_share_out_balances_whole_parameters() -> None:
    assert share_out([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # largest first: 100 + 10 | 60 + 50
    assert share_out([8, 8, 8], 3) == [0, 1, 2]
    assert share_out([5], 2) == [0]


@pytest.mark.parametrize("kind, zero", [("adam", 1), ("sgd", 1), ("adam", 2), ("sgd", 2)])
@pytest.mark.timeout(200)
def test_one_stage_two_replicas(kind: str, zero: int) -> None:
    report = run_ranks(2, train_and_compare, "mlp", 1, kind, zero, timeout=180)
    for r in report:
        assert not r["problems"], "\n".join(r["problems"])
        assert r["zero"] == zero
    shares = [set(r["state"]) for r in report]
    assert shares[0] and shares[1] and not shares[0] & shares[1]  # each replica its own share
    assert shares[0] | shares[1] == set(report[0]["local"])  # together: every parameter
    if zero == 2:  # the step ends holding this share's gradients only
        for r, share in zip(report, shares):
            assert set(r["grads"]) == share
            assert r["held"] < r["stage_bytes"]
    else:
        assert all(r["held"] == r["stage_bytes"] for r in report)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.timeout(300)
def test_two_stages_two_replicas_with_tied_weights(zero: int) -> None:
    report = run_ranks(4, train_and_compare, "gpt", 2, "adam", zero, timeout=280)
    for r in report:
        assert not r["problems"], "\n".join(r["problems"])
    tied = set(report[0]["tied"])
    assert tied  # the GPT's embedding and head
    for position in range(2):  # ranks position and position + 2 are one stage's replicas
        a, b = (set(report[position + 2 * r]["state"]) for r in range(2))
        assert (a & b) == (tied & set(report[position]["local"]))  # only tied weights on both
        assert a | b == set(report[position]["local"])


def test_owners_follow_whole_shapes_so_a_tp_cut_stage_agrees_with_the_others() -> None:
    """A rank of a tp-cut stage holds half of a split weight; a rank of another stage holds it whole
    (or on meta): both must give every parameter the same owner, or they gather from different ranks."""
    def params(cut: bool) -> list[torch.nn.Parameter]:
        split, norm, bias = (torch.nn.Parameter(torch.zeros(n)) for n in ((6 if cut else 12), 8, 5))
        if cut:
            split._plait_tp = TpShard((12,), 0, 1, 0, 2)  # type: ignore[attr-defined]
        return [split, norm, bias]

    owners = [list(zero_owners([ps], 2).values()) for ps in (params(True), params(False))]
    assert owners[0] == owners[1] == [0, 1, 1]  # 12 bytes' worth first, then 8 and 5 on the other


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("widths", [(2, 1), (1, 2)])
@pytest.mark.timeout(300)
def test_stages_of_different_dp_shard_over_their_own_replicas(widths: tuple[int, int], zero: int) -> None:
    """stage_dp: the stage of two replicas shards its state (2: and gradients) over them; the
    stage of one keeps all of its own; the GPT's tied embedding and head is stepped by every holder."""
    report = run_ranks(3, train_and_compare, "gpt", 2, "adam", zero, 4, {"stage_dp": widths}, timeout=280)
    for r in report:
        assert not r["problems"], "\n".join(r["problems"])
        assert r["zero"] == zero
    pair, alone = ([0, 1], 2) if widths == (2, 1) else ([1, 2], 0)
    tied = set(report[0]["tied"])
    assert tied and report[pair[0]]["local"] == report[pair[1]]["local"]
    a, b = (set(report[r]["state"]) for r in pair)
    assert a - tied and b - tied and (a & b) == (tied & set(report[pair[0]]["local"]))  # each its own share
    assert a | b == set(report[pair[0]]["local"])  # together: every parameter of the stage
    assert set(report[alone]["state"]) == set(report[alone]["local"])  # one replica: all of its own
    if zero == 2:  # the replicas end the step holding their share's gradients only
        for r in pair:
            assert set(report[r]["grads"]) == set(report[r]["state"])
            assert report[r]["held"] < report[r]["stage_bytes"]


def save_then_resume(rank: int, world: int, directory: str) -> dict[str, Any]:
    """3 steps at zero=1; 2 steps at zero=1 saved, then resumed for one step at zero=1, 0 and 2 on
    2 replicas, and at dp=1 (2 stages)."""
    _, x, y, _ = make("mlp")
    batches = [(x[a:a + ROWS], y[a:a + ROWS]) for a in range(0, 3 * ROWS, ROWS)]
    full, _ = _model("mlp", 1, 2, 1, "adam")
    for b in batches:
        full.train_on_batch(*b)
    first, _ = _model("mlp", 1, 2, 1, "adam")
    for b in batches[:2]:
        first.train_on_batch(*b)
    first.save(directory)
    out = {"full": full.state_dict()}
    for key, (stages, dp, zero) in {"zero=1": (1, 2, 1), "zero=0": (1, 2, 0), "zero=2": (1, 2, 2),
                                     "dp=1": (2, 1, 0)}.items():
        again, _ = _model("mlp", stages, dp, zero, "adam")
        again.build(batches[0][0])
        again.load(directory)
        again.train_on_batch(*batches[2])
        out[key] = again.state_dict()
    return out


@pytest.mark.timeout(300)
def test_a_zero_checkpoint_resumes_bitwise_at_zero_1_and_equal_at_zero_0_2_another_dp_and_in_one_process(tmp_path: Path) -> None:
    report = run_ranks(2, save_then_resume, str(tmp_path / "ckpt"), timeout=280)
    full = report[0]["full"]
    for key, value in full.items():
        assert torch.equal(report[0]["zero=1"][key], value), key  # the same layout: bitwise
        for other in ("zero=0", "zero=2", "dp=1"):  # another layout: equal within fp32 rounding
            torch.testing.assert_close(report[0][other][key], value, rtol=1e-5, atol=1e-6, msg=f"{other}: {key}")
    # One process (no launcher): the 2-replica zero=1 checkpoint, one more step.
    _, x, y, loss = make("mlp")
    net = make("mlp")[0]
    alone = plait.Model(net, plait.Config(), optimizer=_optimizer("adam"), loss=loss)
    alone.build(x[:ROWS])
    alone.load(tmp_path / "ckpt")
    alone.train_on_batch(x[2 * ROWS:3 * ROWS], y[2 * ROWS:3 * ROWS])
    for key, value in full.items():
        torch.testing.assert_close(alone.state_dict()[key], value, rtol=1e-5, atol=1e-6)
