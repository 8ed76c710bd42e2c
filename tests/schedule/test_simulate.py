"""Tests of the event simulation against the published closed forms, exactly, no processes."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from plait.errors import ScheduleError
from plait.schedule import (
    Event, Simulation, generate, gpipe, interleaved, one_f_one_b, simulate, zbh1,
)
from plait.schedule.timing import clock_cycles


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 17))
def test_gpipe_and_1f1b(p: int, m: int) -> None:
    # GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2021): step (m + p - 1)(t_f + t_b),
    # bubble fraction (p - 1)/(m + p - 1); peak on stage 0: m for GPipe, min(p, m) for 1F1B
    t_f, t_b = 2, 3
    for name, peak in (("gpipe", m), ("1f1b", min(p, m))):
        sim = simulate(name, p, m, t_f, t_b)
        assert sim.step_time == (m + p - 1) * (t_f + t_b)
        assert sim.bubble_fraction == (p - 1) / (m + p - 1)  # both exact: one rounding each
        assert sim.peak_activations[0] == peak
        assert len(sim.timeline) == 2 * p * m


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 17))
def test_unsplit_schedules_run_w_inside_b(p: int, m: int) -> None:
    # a schedule without W pays t_w inside each B: the bubble is (p - 1)(t_f + t_b + t_w)
    sim = simulate("1f1b", p, m, 1, 1, t_w=1)
    assert sim.step_time == 3 * m + 3 * (p - 1)
    assert {e.op for e in sim.timeline} <= {"F", "B"}


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 17))
def test_zbh1(p: int, m: int) -> None:
    # ZB-H1 (Qi et al. 2023): bubble (p - 1)(t_f + t_b - t_w), a third of 1F1B's when the
    # three are equal, for m >= p; peak p micro-batches, as 1F1B
    sim = simulate("zbh1", p, m, 1, 1, 1)
    one_f_one_b_sim = simulate("1f1b", p, m, 1, 1, 1)
    if m >= p:
        assert sim.step_time - 3 * m == (p - 1) * (1 + 1 - 1)
        assert 3 * (sim.step_time - 3 * m) == one_f_one_b_sim.step_time - 3 * m
        assert sim.bubble_fraction == (p - 1) / (3 * m + p - 1)
    assert sim.step_time <= one_f_one_b_sim.step_time
    assert sim.peak_activations == [min(p, m)] * p
    assert len(sim.timeline) == 3 * p * m


@pytest.mark.parametrize("t_f, t_b, t_w", [(2, 2, 1), (3, 2, 1), (2, 3, 1), (5, 4, 3), (2, 2, 2)])
@pytest.mark.parametrize("p, m", [(2, 2), (3, 5), (4, 8), (5, 16), (6, 7)])
def test_zbh1_unequal_costs(t_f: int, t_b: int, t_w: int, p: int, m: int) -> None:
    # the closed form holds while W is no longer than F or B (the paper's setting)
    sim = simulate("zbh1", p, m, t_f, t_b, t_w)
    assert sim.step_time - m * (t_f + t_b + t_w) == (p - 1) * (t_f + t_b - t_w)


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("v", range(1, 5))
@pytest.mark.parametrize("groups", range(1, 5))
def test_interleaved(p: int, v: int, groups: int) -> None:
    # interleaved 1F1B (Narayanan et al. 2021): bubble / ideal = (1/v)(p - 1)/m; peak on rank 0
    # p(1 + (p - 1)/(p v)) micro-batches (a chunk counts 1/v) once m >= 2p, all m when m = p
    m = groups * p
    t_f, t_b = 2 * v, 3 * v  # each chunk's F and B take 2 and 3: every time an integer
    sim = simulate("interleaved", p, m, t_f, t_b, num_virtual_stages=v)
    ideal = m * (t_f + t_b)
    assert Fraction(sim.step_time - ideal) / ideal == Fraction(p - 1, v * m)
    expected = Fraction(min(m * v, p * v + p - 1), v) if v > 1 else Fraction(min(p, m))
    assert sim.peak_activations[0] == float(expected)
    if m >= 2 * p and v > 1:  # v = 1 is plain 1F1B: peak p
        assert expected == p * (1 + Fraction(p - 1, p * v))
    assert {e.rank for e in sim.timeline} == set(range(p))
    assert {e.stage_index % p == e.rank for e in sim.timeline} == {True}


def test_interleaved_with_m_not_a_multiple_of_p() -> None:
    sim = simulate("interleaved", 4, 6, 2, 2, num_virtual_stages=2)
    assert sim.step_time <= simulate("1f1b", 4, 6, 2, 2).step_time
    assert len(sim.timeline) == 2 * 4 * 2 * 6


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1", "interleaved"])
@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (3, 4), (4, 8)])
def test_unit_costs_are_clock_cycles(name: str, p: int, m: int) -> None:
    # one timing model: clock_cycles is simulate with every F, B and W one cycle
    v = 2 if name == "interleaved" else 1
    compute = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zbh1}
    sim = simulate(name, p, m, v, v, 1 if name == "zbh1" else 0, num_virtual_stages=v)
    program = interleaved(p * v, m, v) if name == "interleaved" else compute[name](p, m)
    start = {str(a): c for a, c in clock_cycles(program, p * v).items()}
    assert {f"{e.stage_index}{e.op}{e.microbatch_index}": e.start for e in sim.timeline} == start


def test_per_stage_costs() -> None:
    # a slow middle stage sets the pace: one micro-batch takes the round trip, sum(t_f + t_b);
    # each further one adds the slowest stage's t_f + t_b = 7 (GPipe: Alpa's latency model
    # T = sum_i t_i + (m - 1) max_i t_i; 1F1B overlaps micro-batch 1 a little better)
    t_f, t_b = [1, 3, 1], [2, 4, 2]
    gpipe_steps = [simulate("gpipe", 3, m, t_f, t_b).step_time for m in range(1, 9)]
    one_f_one_b_steps = [simulate("1f1b", 3, m, t_f, t_b).step_time for m in range(1, 9)]
    assert gpipe_steps == [13 + 7 * (m - 1) for m in range(1, 9)]
    assert one_f_one_b_steps == [13] + [17 + 7 * (m - 2) for m in range(2, 9)]
    for m in range(1, 9):
        # forwards alone are a flow shop of identical jobs: sum_i t_i + (m - 1) max_i t_i
        for name in ("gpipe", "1f1b"):
            assert simulate(name, 3, m, t_f, 0).step_time == 5 + (m - 1) * 3
            assert simulate(name, 3, m, 0, t_b).step_time == 8 + (m - 1) * 4
        sim = simulate("1f1b", 3, m, t_f, t_b)
        busy = m * (sum(t_f) + sum(t_b))
        assert sim.bubble_fraction == pytest.approx(1 - busy / (3 * sim.step_time), abs=1e-15)


def test_per_chunk_costs() -> None:
    # p = 2, v = 2: a list of p costs is split over the chunks; a list of p v is per chunk,
    # in stage order (chunk c of rank r is stage c p + r)
    by_rank = simulate("interleaved", 2, 4, [2, 4], [2, 4], num_virtual_stages=2)
    by_chunk = simulate("interleaved", 2, 4, [1, 2, 1, 2], [1, 2, 1, 2], num_virtual_stages=2)
    assert by_rank == by_chunk
    durations = {(e.stage_index, e.op): e.end - e.start for e in by_chunk.timeline}
    assert durations == {(0, "F"): 1, (1, "F"): 2, (2, "F"): 1, (3, "F"): 2,
                         (0, "B"): 1, (1, "B"): 2, (2, "B"): 1, (3, "B"): 2}


def test_comm_time() -> None:
    # every hand-over between ranks costs t_comm: GPipe's critical path crosses p - 1 ranks
    # forward and p - 1 back
    for p, m in [(2, 1), (3, 4), (4, 8)]:
        base = simulate("gpipe", p, m, 1, 2).step_time
        assert simulate("gpipe", p, m, 1, 2, t_comm=0.5).step_time == base + 2 * (p - 1) * 0.5
    # one rank: nothing crosses a rank, so t_comm costs nothing, even with several chunks
    assert simulate("interleaved", 1, 3, 2, 2, t_comm=5, num_virtual_stages=2).step_time == 12
    sim = simulate("1f1b", 2, 1, 1, 1, t_comm=Fraction(1, 4))
    assert [(e.stage_index, e.op, e.start, e.end) for e in sim.timeline] == [
        (0, "F", 0, 1), (1, "F", 1.25, 2.25), (1, "B", 2.25, 3.25), (0, "B", 3.5, 4.5)]


def test_timeline_respects_ranks_and_dependencies() -> None:
    sim = simulate("zbh1", 4, 6, 1.5, 2.5, 0.75, t_comm=0.25)
    by_rank: dict[int, list[Event]] = {}
    for event in sim.timeline:
        by_rank.setdefault(event.rank, []).append(event)
    for events in by_rank.values():  # one action at a time on a rank
        for a, b in zip(events, events[1:]):
            assert a.end <= b.start
    end = {(e.stage_index, e.op, e.microbatch_index): e.end for e in sim.timeline}
    for e in sim.timeline:
        s, k = e.stage_index, e.microbatch_index
        if e.op == "F" and s > 0:
            assert e.start >= end[(s - 1, "F", k)] + 0.25
        if e.op == "B" and s < 3:
            assert e.start >= end[(s + 1, "B", k)] + 0.25
        if e.op == "W":
            assert e.start >= end[(s, "B", k)]
    assert sim.timeline == sorted(sim.timeline, key=lambda e: (e.start, e.rank, e.end))
    assert sim.step_time == max(e.end for e in sim.timeline)


def test_results_are_frozen_and_plain() -> None:
    sim = simulate("1f1b", 2, 2, 1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sim.step_time = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sim.timeline[0].start = 1  # type: ignore[misc]
    assert isinstance(sim, Simulation) and type(sim.step_time) is float
    assert sim.timeline[0] == Event(rank=0, stage_index=0, op="F", microbatch_index=0,
                                    start=0.0, end=1.0)


def test_zero_costs() -> None:
    sim = simulate("1f1b", 3, 2, 0, 0)
    assert sim.step_time == 0 and sim.bubble_fraction == 0


def test_runs_the_generated_program() -> None:
    # the simulator times what `generate` gives the runtime, in the same per-rank order
    program = generate("interleaved", 6, 5, num_virtual_stages=2)
    sim = simulate("interleaved", 3, 5, 1, 1, num_virtual_stages=2)
    for rank, actions in program.items():
        computed = [str(a) for a in actions if a.op.value in ("F", "B", "W")]
        timed = [f"{e.stage_index}{e.op}{e.microbatch_index}" for e in sim.timeline
                 if e.rank == rank]
        assert timed == computed


@pytest.mark.parametrize("kwargs, message", [
    ({"t_f": -1.0}, r"t_f must be a finite number >= 0 \(a time\), got -1.0"),
    ({"t_b": float("inf")}, r"t_b must be a finite number >= 0 \(a time\), got inf"),
    ({"t_w": [1, -2, 1]}, r"t_w\[1\] must be a finite number >= 0 \(a time\), got -2"),
    ({"t_comm": float("nan")}, r"t_comm must be a finite number >= 0 \(a time\), got nan"),
    ({"t_f": "1"}, r"t_f must be a finite number >= 0 \(a time\), got '1'"),
    ({"t_b": True}, r"t_b must be a finite number >= 0 \(a time\), got True"),
    ({"t_f": [1, 2]}, r"t_f has 2 entries, but the pipeline has 3 stages; give one number, or "
                      r"a list of 3 \(one per pipeline stage\)$"),
    ({"t_f": [1, 2], "num_virtual_stages": 2, "schedule": "interleaved"},
     r"t_f has 2 entries, .* a list of 3 \(one per pipeline stage\) or 6 \(one per chunk, in "
     r"stage order\)"),
    ({"schedule": "zb"}, r"unknown schedule 'zb'; known schedules: 1f1b, gpipe, interleaved, "
                         r"zbh1"),
    ({"num_virtual_stages": 2}, r"schedule '1f1b' runs one stage per rank, but "
                                r"num_virtual_stages=2; use schedule='interleaved'"),
    ({"num_virtual_stages": 0}, r"num_virtual_stages must be an int >= 1, got 0"),
    ({"num_stages": 0}, r"num_stages must be an int >= 1, got 0"),
    ({"num_microbatches": 2.5}, r"num_microbatches must be an int >= 1, got 2.5"),
])
def test_bad_input(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"schedule": "1f1b", "num_stages": 3, "num_microbatches": 4,
                               "t_f": 1.0, "t_b": 2.0}
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=message):
        simulate(**args)  # type: ignore[arg-type]
