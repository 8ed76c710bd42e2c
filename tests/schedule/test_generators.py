"""Tests of the one-stage-per-rank generators: exact per-rank orders, peak memory, pictures."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from plait.errors import ScheduleError
from plait.schedule import (
    Action, Op, Program, format_program, forward_only, generate, gpipe, one_f_one_b, zbh1,
)
from plait.schedule import generators
from plait.schedule.generators import order_1f1b
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


def test_zbh1_exact() -> None:
    # 1F1B's F and B order; stage s puts W(k) right after B(k + s), the rest at the end
    assert lines(zbh1(3, 4)) == [
        "rank 0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
    ]
    # Qi et al. 2023, Fig. 3 (ZB-H1, p = 4, m = 8), last worker: W1 follows B4, 1-based
    assert lines(zbh1(4, 8))[3] == (
        "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 "
        "3F7 3B7 3W4 3W5 3W6 3W7"
    )
    assert lines(zbh1(1, 2)) == ["rank 0: 0F0 0B0 0W0 0F1 0B1 0W1"]
    # m < p: stages past m have no B to hang a W on before the end
    assert lines(zbh1(3, 1)) == ["rank 0: 0F0 0B0 0W0", "rank 1: 1F0 1B0 1W0",
                                 "rank 2: 2F0 2B0 2W0"]


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 17))
def test_zbh1_is_1f1b_with_split_backward(p: int, m: int) -> None:
    split = zbh1(p, m)
    assert {s: [a for a in split[s] if a.op is not Op.WEIGHT] for s in split} == one_f_one_b(p, m)
    for s, actions in split.items():
        weights = [a.microbatch_index for a in actions if a.op is Op.WEIGHT]
        assert weights == list(range(m))  # each W once, in micro-batch order
        for k in range(m):  # and after its own B
            assert actions.index(Action(s, Op.WEIGHT, k)) > actions.index(Action(s, Op.BACKWARD, k))


def test_order_1f1b() -> None:
    f = [Action(0, Op.FORWARD, k) for k in range(3)]
    b = [Action(0, Op.BACKWARD, k) for k in range(3)]
    assert [str(a) for a in order_1f1b(f, b, 1)] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert order_1f1b(f, b, 3) == f + b
    assert order_1f1b(f, b, 0) == [f[0], b[0], f[1], b[1], f[2], b[2]]


def test_forward_only_exact() -> None:
    assert lines(forward_only(3, 2)) == ["rank 0: 0F0 0F1", "rank 1: 1F0 1F1", "rank 2: 2F0 2F1"]
    assert lines(forward_only(1, 1)) == ["rank 0: 0F0"]


def peak_in_flight(program: Program, rank: int) -> int:
    """Most activations held at once: forwards done minus backwards done (W when the backward
    is split), maximised."""
    release = Op.WEIGHT if any(a.op is Op.WEIGHT for a in program[rank]) else Op.BACKWARD
    held, peak = 0, 0
    for action in program[rank]:
        held += {Op.FORWARD: 1, release: -1}.get(action.op, 0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 10))
def test_peak_activations_on_stage_0(p: int, m: int) -> None:
    # GPipe (Huang et al. 2019) holds m micro-batches on stage 0, 1F1B (Narayanan et al. 2021)
    # min(p, m)
    assert peak_in_flight(gpipe(p, m), 0) == m
    assert peak_in_flight(one_f_one_b(p, m), 0) == min(p, m)
    assert peak_in_flight(generate("1f1b", p, m), 0) == min(p, m)
    for s in range(p):  # stage s of 1F1B holds min(p - s, m)
        assert peak_in_flight(one_f_one_b(p, m), s) == min(p - s, m)
    # ZB-H1 keeps 1F1B's peak, p on stage 0 (a micro-batch is held until its W); every stage
    # holds as much, since stage s delays its W passes by s
    for s in range(p):
        assert peak_in_flight(zbh1(p, m), s) == min(p, m)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zbh1, forward_only])
@pytest.mark.parametrize("p, m, name, value", [
    (0, 1, "num_stages", "0"), (2, 0, "num_microbatches", "0"),
    (-1, 1, "num_stages", "-1"), (2, True, "num_microbatches", "True"),
])
def test_generators_reject_bad_sizes(
    make: Callable[[int, int], Program], p: int, m: int, name: str, value: str
) -> None:
    with pytest.raises(ScheduleError, match=f"{name} must be an int >= 1, got {value}"):
        make(p, m)


def test_module_pictures_match_the_code() -> None:
    doc = generators.__doc__
    assert doc is not None
    for make in (gpipe, one_f_one_b, zbh1):
        for line in format_timeline(make(3, 4), 3).splitlines():
            assert f"    {line}\n" in doc
