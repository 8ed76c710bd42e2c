"""The planner's float timing equals `simulate` on every schedule, and prices each boundary."""

from __future__ import annotations

import random

import pytest

from plait.errors import ScheduleError
from plait.schedule import simulate
from plait.schedule.steptime import compile_schedule, time_step


@pytest.mark.parametrize("seed", range(60))
def test_equals_simulate_on_random_costs(seed: int) -> None:
    rng = random.Random(seed)
    name = rng.choice(["gpipe", "1f1b", "zbh1", "interleaved"])
    p, m = rng.randint(1, 5), rng.randint(1, 10)
    v = rng.randint(2, 3) if name == "interleaved" else 1
    stages = p * v
    f = [rng.randint(1, 6) for _ in range(stages)]
    b = [rng.randint(1, 6) for _ in range(stages)]
    w = [rng.randint(0, 3) for _ in range(stages)]
    comm = rng.choice([0, 0.5, 2])
    sim = simulate(name, p, m, f, b, t_w=w, t_comm=comm, num_virtual_stages=v)
    compiled = compile_schedule(name, p, m, v)
    timed = time_step(compiled, f, b, w, comm)
    assert timed.step_time == pytest.approx(sim.step_time, abs=1e-9)
    assert list(compiled.peak_activations) == sim.peak_activations
    # each rank's end and last gradient pass, read off simulate's timeline
    grad_op = "W" if name == "zbh1" else "B"
    for rank in range(p):
        events = [e for e in sim.timeline if e.rank == rank]
        assert timed.rank_end[rank] == pytest.approx(max(e.end for e in events))
        assert timed.last_grad_start[rank] == pytest.approx(
            max(e.start for e in events if e.op == grad_op))


@pytest.mark.parametrize("seed", range(20))
def test_gpipe_per_boundary_hand_overs_follow_the_flow_shop_form(seed: int) -> None:
    # GPipe's forwards, then its backwards, are each a flow shop of m identical jobs:
    # sum of the stages + (m - 1) x the slowest + every boundary's lag, once each way
    rng = random.Random(seed)
    p, m = rng.randint(1, 6), rng.randint(1, 9)
    f = [rng.randint(1, 9) for _ in range(p)]
    b = [rng.randint(1, 9) for _ in range(p)]
    comm = [rng.randint(0, 4) for _ in range(p - 1)]
    timed = time_step(compile_schedule("gpipe", p, m), f, b, 0.0, comm)
    assert timed.step_time == sum(f) + sum(b) + (m - 1) * (max(f) + max(b)) + 2 * sum(comm)


def test_a_hand_over_on_one_rank_is_free() -> None:
    # interleaved on one rank: the boundary between its two chunks stays on rank 0, so no
    # lag is paid: 2 chunks x 4 micro-batches x (F + B)
    compiled = compile_schedule("interleaved", 1, 4, 2)
    assert time_step(compiled, 1, 1, 0, [100.0]).step_time == 16


def test_wrong_number_of_costs() -> None:
    with pytest.raises(ScheduleError, match="3 entries; give one number or 2"):
        time_step(compile_schedule("1f1b", 2, 2), [1, 2, 3], 1)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        compile_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="interleaved"):
        compile_schedule("1f1b", 2, 2, 2)
