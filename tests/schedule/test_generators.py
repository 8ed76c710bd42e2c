"""Tests of the schedule generators and `generate`: exact per-rank orders and peak memory."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from plait.errors import ScheduleError
from plait.schedule import (
    SCHEDULES, Op, Program, format_program, forward_only, generate, gpipe, one_f_one_b,
)
from plait.schedule import generators
from plait.schedule.timing import format_timeline


def lines(program: Program) -> list[str]:
    return format_program(program).splitlines()


def test_gpipe_exact() -> None:
    assert lines(gpipe(2, 2)) == ["rank 0: 0F0 0F1 0B0 0B1", "rank 1: 1F0 1F1 1B0 1B1"]
    assert lines(gpipe(3, 4)) == [
        "rank 0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "rank 1: 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        "rank 2: 2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3",
    ]
    assert lines(gpipe(4, 2)) == [f"rank {s}: {s}F0 {s}F1 {s}B0 {s}B1" for s in range(4)]
    assert lines(gpipe(1, 3)) == ["rank 0: 0F0 0F1 0F2 0B0 0B1 0B2"]


def test_one_f_one_b_exact() -> None:
    assert lines(one_f_one_b(2, 2)) == ["rank 0: 0F0 0F1 0B0 0B1", "rank 1: 1F0 1B0 1F1 1B1"]
    # warmup 2, 1, 0 forwards; then F,B pairs; then cooldown backwards
    assert lines(one_f_one_b(3, 4)) == [
        "rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    # m < p: warmup is capped at m, so stages 0 and 1 look like GPipe
    assert lines(one_f_one_b(4, 2)) == [
        "rank 0: 0F0 0F1 0B0 0B1",
        "rank 1: 1F0 1F1 1B0 1B1",
        "rank 2: 2F0 2F1 2B0 2B1",
        "rank 3: 3F0 3B0 3F1 3B1",
    ]
    assert lines(one_f_one_b(1, 3)) == ["rank 0: 0F0 0B0 0F1 0B1 0F2 0B2"]


def test_forward_only_exact() -> None:
    assert lines(forward_only(3, 2)) == ["rank 0: 0F0 0F1", "rank 1: 1F0 1F1", "rank 2: 2F0 2F1"]
    assert lines(forward_only(1, 1)) == ["rank 0: 0F0"]


def test_schedules_registry() -> None:
    assert SCHEDULES == {"gpipe": gpipe, "1f1b": one_f_one_b}


def peak_in_flight(program: Program, rank: int) -> int:
    """Most activations held at once: forwards done minus backwards done, maximised."""
    held, peak = 0, 0
    for action in program[rank]:
        held += {Op.FORWARD: 1, Op.BACKWARD: -1}.get(action.op, 0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 10))
def test_peak_activations_on_stage_0(p: int, m: int) -> None:
    # ANCHORS: GPipe holds m micro-batches on stage 0, 1F1B min(p, m)
    assert peak_in_flight(gpipe(p, m), 0) == m
    assert peak_in_flight(one_f_one_b(p, m), 0) == min(p, m)
    assert peak_in_flight(generate("1f1b", p, m), 0) == min(p, m)
    for s in range(p):  # stage s of 1F1B holds min(p - s, m)
        assert peak_in_flight(one_f_one_b(p, m), s) == min(p - s, m)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, forward_only])
@pytest.mark.parametrize("p, m, name, value", [
    (0, 1, "num_stages", "0"), (2, 0, "num_microbatches", "0"),
    (-1, 1, "num_stages", "-1"), (2, True, "num_microbatches", "True"),
])
def test_generators_reject_bad_sizes(
    make: Callable[[int, int], Program], p: int, m: int, name: str, value: str
) -> None:
    with pytest.raises(ScheduleError, match=f"{name} must be an int >= 1, got {value}"):
        make(p, m)


def test_generate_lowers_and_validates() -> None:
    assert lines(generate("1f1b", 2, 2)) == [
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1",
        "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1",
    ]
    assert lines(generate("gpipe", 2, 2, forward_only=True)) == [
        "rank 0: 0F0 0SF0 0F1 0SF1", "rank 1: 1RF0 1F0 1RF1 1F1",
    ]
    assert lines(generate("gpipe", 1, 2)) == ["rank 0: 0F0 0F1 0B0 0B1"]


def test_generate_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zb'; known schedules: 1f1b, gpipe"):
        generate("zb", 2, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        generate("zb", 2, 2, forward_only=True)


def test_generate_with_two_stages_on_one_rank() -> None:
    # stages 0 and 1 on rank 0, merged in clock-cycle order; only the 1 -> 2 boundary talks
    program = generate("gpipe", 3, 2, stage_to_rank={0: 0, 1: 0, 2: 1})
    assert lines(program) == [
        "rank 0: 0F0 0F1 1F0 1SF0 1F1 1SF1 1RB0 1B0 0B0 1RB1 1B1 0B1",
        "rank 1: 2RF0 2F0 2RF1 2F1 2B0 2SB0 2B1 2SB1",
    ]


def test_generate_with_permuted_ranks() -> None:
    program = generate("1f1b", 2, 2, stage_to_rank={0: 1, 1: 0})
    assert lines(program) == [
        "rank 0: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1",
        "rank 1: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1",
    ]


def test_module_pictures_match_the_code() -> None:
    doc = generators.__doc__
    assert doc is not None
    for make in (gpipe, one_f_one_b):
        for line in format_timeline(make(3, 4), 3).splitlines():
            assert f"    {line}\n" in doc
