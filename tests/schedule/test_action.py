"""Tests of the action text form and the program printers."""

from __future__ import annotations

import pytest

from plait.errors import ScheduleError
from plait.schedule import Action, Op, format_grid, format_program, parse_action


def test_text_form_of_each_op() -> None:
    assert str(Action(2, Op.FORWARD, 0)) == "2F0"
    assert str(Action(1, Op.SEND_F, 3)) == "1SF3"
    assert str(Action(0, Op.RECV_B, 2)) == "0RB2"
    assert str(Action(0, Op.WEIGHT, 3)) == "0W3"
    assert [op.value for op in Op] == ["F", "B", "W", "SF", "RF", "SB", "RB"]


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("stage, microbatch", [(0, 0), (3, 7), (12, 345)])
def test_parse_round_trip(op: Op, stage: int, microbatch: int) -> None:
    action = Action(stage, op, microbatch)
    assert parse_action(str(action)) == action
    assert str(parse_action(str(action))) == f"{stage}{op.value}{microbatch}"


def test_parse_ignores_surrounding_whitespace() -> None:
    assert parse_action(" 2B1\n") == Action(2, Op.BACKWARD, 1)


@pytest.mark.parametrize(
    "text", ["", "F0", "0F", "0X0", "-1F0", "0 F 0", "0FF0", "0f0", "1SFB2", "0WB1", "0w0", "0SW0"]
)
def test_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ScheduleError) as info:
        parse_action(text)
    message = str(info.value)
    assert repr(text) in message
    assert "<stage><op><microbatch>" in message and "'2F0'" in message


def test_action_checks_its_fields() -> None:
    with pytest.raises(ScheduleError, match="stage_index must be an int >= 0, got -1"):
        Action(-1, Op.FORWARD, 0)
    with pytest.raises(ScheduleError, match="microbatch_index must be an int >= 0, got 1.5"):
        Action(0, Op.FORWARD, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="op must be one of F, B, W, SF, RF, SB, RB, got 'X'"):
        Action(0, "X", 0)  # type: ignore[arg-type]
    assert Action(0, "SB", 1).op is Op.SEND_B  # type: ignore[arg-type]


def test_parse_weight_action() -> None:
    # the weight-gradient half of a split backward: stage 0, micro-batch 3
    assert parse_action("0W3") == Action(0, Op.WEIGHT, 3)
    assert parse_action("12W345").op is Op.WEIGHT


def test_actions_are_hashable_values() -> None:
    assert Action(1, Op.FORWARD, 2) == parse_action("1F2")
    assert len({Action(1, Op.FORWARD, 2), parse_action("1F2"), parse_action("1B2")}) == 2


def test_format_program() -> None:
    program = {1: [parse_action("1RF0"), parse_action("1F0")], 0: [parse_action("0F0"),
               parse_action("0SF0")], 2: []}
    assert format_program(program) == "rank 0: 0F0 0SF0\nrank 1: 1RF0 1F0\nrank 2:"


def test_format_grid_marks_positions() -> None:
    program = {
        0: [parse_action(t) for t in "0F0 0SF0 0RB0 0B0".split()],
        1: [parse_action(t) for t in "1RF0 1F0 1B0 1SB0".split()],
    }
    assert format_grid(program, {0: 2, 1: 4}) == (
        "step   | 0      1      2      3\n"
        "rank 0 | 0F0    0SF0  [0RB0]  0B0\n"
        "rank 1 | 1RF0   1F0    1B0    1SB0   (done)"
    )
    unmarked = format_grid(program)
    assert "[" not in unmarked and "done" not in unmarked
    assert unmarked.splitlines()[1] == "rank 0 | 0F0    0SF0   0RB0   0B0"


def test_format_grid_docstring_example_is_real() -> None:
    program = {
        0: [parse_action(t) for t in "0F0 0SF0 0RB0 0B0".split()],
        1: [parse_action(t) for t in "1RF0 1F0 1B0 1SB0".split()],
    }
    assert format_grid.__doc__ is not None
    for line in format_grid(program, {0: 2, 1: 4}).splitlines():
        assert f"        {line}\n" in format_grid.__doc__
