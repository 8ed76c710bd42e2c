"""A peer that stalls (alive, but silent) is reported by the other ranks within timeout_s, by rank.

Inside a step: the stalled rank sleeps in its forward or backward of step 2 until the other
rank has reported (then it goes on and fails too). A rank whose part of step 2 needs nothing
more from the stalled one (its loss sums went out after the forwards) finishes that step and
reports at step 3's first receive. The other rank must fail with a
PipelineError that names the silent rank, in time: its wait times out after timeout_s, then it
collects the failing ranks' reports for about one more timeout
(plait.runtime.failure.report_wait). The margin is for a busy machine: 2 ranks on 2 shared CPU
cores can lose seconds to scheduling.

Before a step: a rank that never starts it leaves the others waiting at their first receive;
each of their reports names it and marks where every rank stood.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import plait
from tests.harness import run_ranks
from tests.models import mlp

TIMEOUT_S = 5.0
MARGIN_S = 25.0
MICROBATCHES = 2


def data(n: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


# -- a peer that stalls inside a step -------------------------------------------------------------


def _stall_at(name: str, call: int, stamp: str, released: str) -> None:
    """StageExecutor.`name`'s `call`-th call writes the time to `stamp`, then sleeps until
    `released` exists (at most 120 s): this rank is alive but sends nothing."""
    from plait.runtime import executor

    original, count = getattr(executor.StageExecutor, name), [0]

    def stalling(*args, **kwargs):
        count[0] += 1
        if count[0] == call:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            until = time.monotonic() + 120.0
            while not os.path.exists(released) and time.monotonic() < until:
                time.sleep(0.1)
        return original(*args, **kwargs)

    setattr(executor.StageExecutor, name, stalling)


def train(rank: int, world: int, victim: int, name: str, stamp: str, released: str):
    x, y = data(30)
    torch.manual_seed(0)
    model = plait.Model(mlp(), plait.Config(layers_per_stage=(5, 6), num_microbatches=MICROBATCHES,
                                            timeout_s=TIMEOUT_S),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    if rank == victim:
        _stall_at(name, MICROBATCHES + 1, stamp, released)  # the first micro-batch of step 2
    try:
        for a in range(0, 30, 10):
            model.train_on_batch(x[a:a + 10], y[a:a + 10])
    except plait.PlaitError as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    ended = time.time()
    if rank != victim:
        with open(released, "w"):
            pass
    return ended, error


CASES = [  # victim, where it stalls, what the other rank's report says of its own wait
    # rank 0 waits on the wire for the gradients of its first micro-batch
    (1, "forward", ["rank 0 failed at action 0RB0", "peer rank 1"]),
    # rank 1 has done its part of step 2 (rank 0's loss sums went out after its forwards) and
    # waits at step 3's first receive
    (0, "backward", ["rank 1 failed at action 1RF0", "peer rank 0"]),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim, name, waited", CASES, ids=[f"rank{c[0]}-{c[1]}" for c in CASES])
def test_a_stalled_peer_is_named_within_timeout_s(tmp_path, victim, name, waited):
    stamp, released = str(tmp_path / "stalled"), str(tmp_path / "released")
    results = run_ranks(2, train, victim, name, stamp, released, timeout=140)
    stalled = float(open(stamp).read())
    ended, error = results[1 - victim]
    assert error is not None and error.startswith("PipelineError"), error
    assert f"no report from ranks [{victim}]" in error, error
    assert all(part in error for part in waited), error
    assert ended - stalled < TIMEOUT_S + MARGIN_S, (ended - stalled, error)
    print(f"rank {1 - victim} reported {ended - stalled:.1f} s after rank {victim} stalled")


# -- a peer that never starts its step ------------------------------------------------------------


def stalled_step(rank: int, config: plait.Config, silent: int, sleep_s: float) -> str:
    """One training step in which rank `silent` never runs its part (it sleeps past the others'
    timeout_s and their report collection); the others' error text, or "slept"."""
    x, y = data()
    model = plait.Model(mlp(), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    if rank == silent:
        model.build(x)
        time.sleep(sleep_s)
        return "slept"
    try:
        model.train_on_batch(x, y)
    except plait.PipelineError as e:
        return str(e)
    return "no error"


def stall(rank, world):
    """Rank 2 never runs its part: ranks 0 and 1 fail within timeout_s, each report marks both."""
    # timeout_s: long enough that the healthy ranks' own first messages arrive on a loaded machine
    return stalled_step(rank, plait.Config(layers_per_stage=(3, 4, 4), num_microbatches=2, timeout_s=6),
                        silent=2, sleep_s=16)


@pytest.mark.timeout(90)
def test_a_stalled_peer_gives_a_report_not_a_hang():
    first, second, _ = run_ranks(3, stall, timeout=80)
    # rank 0 waits for gradients that rank 1 cannot make; rank 1 waits for rank 2
    assert "rank 0 failed at action 0RB0" in first and "peer rank 1" in first, first
    assert "rank 1 failed at action 1RB0" in second and "peer rank 2" in second, second
    for message in (first, second):
        assert "[0RB0]" in message and "[1RB0]" in message  # both positions are marked
        assert "no report from ranks [2]" in message


def stall_zero_bubble(rank, world):
    """ZB-H1 on 2 ranks, rank 1 never runs: rank 0's wait ends in a report, not a hang."""
    return stalled_step(rank, plait.Config(layers_per_stage=(5, 6), num_microbatches=3, timeout_s=6,
                                           schedule="zbh1"), silent=1, sleep_s=18)


@pytest.mark.timeout(90)
def test_watchdog_reports_a_stalled_zero_bubble_peer():
    report, slept = run_ranks(2, stall_zero_bubble, timeout=80)
    assert slept == "slept"
    assert "rank 0 failed at action 0RB0" in report and "peer rank 1" in report, report
    assert "[0RB0]" in report and "no report from ranks [1]" in report, report
    assert "0W0" in report  # the grid shows the split backward's W actions
