"""Tests of unit-cost clock cycles against the published bubble closed forms."""

from __future__ import annotations

import pytest

from plait.errors import ScheduleError
from fractions import Fraction

from plait.schedule import Action, Op, gpipe, one_f_one_b, parse_action, zbh1
from plait.schedule.timing import clock_cycles, compute_needs, format_timeline, time_actions


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 10))
def test_step_length_and_bubble(p: int, m: int) -> None:
    # Narayanan et al. 2021 (Megatron-LM): batch time (m + p - 1)(t_f + t_b); bubble (p - 1)(t_f + t_b) per stage
    for make in (gpipe, one_f_one_b):
        start = clock_cycles(make(p, m), p)
        step = max(start.values()) + 1
        assert step == 2 * (m + p - 1)
        busy_per_stage = 2 * m
        assert step - busy_per_stage == 2 * (p - 1)


def test_exact_cycles_small() -> None:
    start = clock_cycles(one_f_one_b(2, 2), 2)
    assert {str(a): c for a, c in start.items()} == {
        "0F0": 0, "0F1": 1, "0B0": 3, "0B1": 5, "1F0": 1, "1B0": 2, "1F1": 3, "1B1": 4,
    }


def test_weight_pass_takes_a_cycle_after_its_backward() -> None:
    start = clock_cycles(zbh1(2, 2), 2)
    assert {str(a): c for a, c in start.items()} == {
        "0F0": 0, "0F1": 1, "0B0": 3, "0W0": 4, "0B1": 5, "0W1": 6,
        "1F0": 1, "1B0": 2, "1F1": 3, "1B1": 4, "1W0": 5, "1W1": 6,
    }
    assert compute_needs(parse_action("1W3"), 2) == [parse_action("1B3")]
    assert compute_needs(parse_action("0B3"), 2) == [parse_action("0F3"), parse_action("1B3")]


def test_time_actions_with_costs_and_transfer() -> None:
    # 1F1B on 2 ranks, one micro-batch: F costs 2, B costs 3, each rank crossing 1/2
    cost = {Op.FORWARD: Fraction(2), Op.BACKWARD: Fraction(3)}
    times = time_actions(one_f_one_b(2, 1), 2, lambda a: cost[a.op], Fraction(1, 2))
    assert {str(a): t for a, t in times.items()} == {
        "0F0": (0, 2), "1F0": (Fraction(5, 2), Fraction(9, 2)),
        "1B0": (Fraction(9, 2), Fraction(15, 2)), "0B0": (8, 11),
    }


def test_timeline_docstring_example_is_real() -> None:
    assert format_timeline.__doc__ is not None
    for line in format_timeline(one_f_one_b(2, 2), 2).splitlines():
        assert f"        {line}\n" in format_timeline.__doc__


def test_rejects_communication_and_stuck_programs() -> None:
    with pytest.raises(ScheduleError, match=r"compute-only program \(F, B and W\), but rank 0 "
                       r"holds 0SF0; time the program before lower_communication"):
        clock_cycles({0: [parse_action("0F0"), parse_action("0SF0")]}, 2)
    with pytest.raises(ScheduleError, match=r"cannot time the program: ranks wait forever at "
                       r"\{0: '0B0'\}; run validate\(\)"):
        clock_cycles({0: [Action(0, Op.BACKWARD, 0), Action(0, Op.FORWARD, 0)]}, 1)
