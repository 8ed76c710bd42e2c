"""Tests of unit-cost clock cycles against the published bubble closed forms."""

from __future__ import annotations

import pytest

from plait.errors import ScheduleError
from plait.schedule import Action, Op, gpipe, one_f_one_b, parse_action
from plait.schedule.timing import clock_cycles, format_timeline


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 10))
def test_step_length_and_bubble(p: int, m: int) -> None:
    # ANCHORS / Megatron: batch time (m + p - 1)(t_f + t_b); bubble (p - 1)(t_f + t_b) per stage
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


def test_timeline_docstring_example_is_real() -> None:
    assert format_timeline.__doc__ is not None
    for line in format_timeline(one_f_one_b(2, 2), 2).splitlines():
        assert f"        {line}\n" in format_timeline.__doc__


def test_rejects_communication_and_stuck_programs() -> None:
    with pytest.raises(ScheduleError, match="compute-only program .* rank 0 holds 0SF0"):
        clock_cycles({0: [parse_action("0F0"), parse_action("0SF0")]}, 2)
    with pytest.raises(ScheduleError, match=r"cannot time the program: ranks wait forever at "
                       r"\{0: '0B0'\}; run validate\(\)"):
        clock_cycles({0: [Action(0, Op.BACKWARD, 0), Action(0, Op.FORWARD, 0)]}, 1)
