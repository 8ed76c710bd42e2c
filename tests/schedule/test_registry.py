"""Tests of `generate` and the registry: names, placement, lowering and the split backward."""

from __future__ import annotations

import pytest

from plait.schedule.registry import SCHEDULE_NAMES

from plait.errors import ScheduleError
from plait.schedule import (
    SCHEDULES, Op, Program, format_program, generate, gpipe, interleaved, one_f_one_b,
    splits_backward, zbh1,
)


def lines(program: Program) -> list[str]:
    return format_program(program).splitlines()


def test_schedules_registry() -> None:
    assert SCHEDULES == {
        "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zbh1": zbh1,
    }
    assert tuple(SCHEDULES) == SCHEDULE_NAMES  # the one list of names: a generator for each


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



def test_generate_zbh1_lowers_w_without_communication() -> None:
    # W needs only its own B: nothing is sent or received around it
    assert lines(generate("zbh1", 2, 2)) == [
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0W0 0RB1 0B1 0W1",
        "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1W0 1W1",
    ]
    assert lines(generate("zbh1", 2, 1, forward_only=True)) == [
        "rank 0: 0F0 0SF0", "rank 1: 1RF0 1F0",
    ]


def test_generate_interleaved_places_stage_s_on_rank_s_mod_p() -> None:
    # p = 2 ranks, v = 2 chunks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; the
    # hand-over 1 -> 2 wraps from rank 1 back to rank 0. m = p: every forward first (Megatron)
    program = generate("interleaved", 4, 2, num_virtual_stages=2)
    assert lines(program) == [
        "rank 0: 0F0 0SF0 0F1 0SF1 2RF0 2F0 2SF0 2RF1 2F1 2SF1 2RB0 2B0 2SB0 2RB1 2B1 2SB1 "
        "0RB0 0B0 0RB1 0B1",
        "rank 1: 1RF0 1F0 1SF0 1RF1 1F1 1SF1 3RF0 3F0 3RF1 3F1 3B0 3SB0 3B1 3SB1 1RB0 1B0 "
        "1SB0 1RB1 1B1 1SB1",
    ]


def test_generate_interleaved_with_a_replica_offset() -> None:
    # the runtime passes global ranks: replica 1 of a dp x pp layout owns ranks 2 and 3
    offset = {s: 2 + s % 2 for s in range(4)}
    program = generate("interleaved", 4, 4, num_virtual_stages=2, stage_to_rank=offset)
    default = generate("interleaved", 4, 4, num_virtual_stages=2)
    assert program == {2 + r: actions for r, actions in default.items()}


def test_generate_interleaved_on_one_rank_talks_to_no_one() -> None:
    # p = 1: every stage on rank 0, every hand-over local
    program = generate("interleaved", 3, 2, num_virtual_stages=3)
    assert list(program) == [0]
    assert {a.op for a in program[0]} == {Op.FORWARD, Op.BACKWARD}
    # groups of p = 1 micro-batch; warmup (v - 1) * 1 = 2 forwards, then one F, one B
    assert lines(program) == ["rank 0: 0F0 1F0 2F0 2B0 0F1 1B0 1F1 0B0 2F1 2B1 1B1 0B1"]


def test_generate_interleaved_merges_positions_given_one_rank() -> None:
    # a stage_to_rank that puts both positions on one rank merges them by clock cycle
    one_rank = {s: 0 for s in range(4)}
    program = generate("interleaved", 4, 4, num_virtual_stages=2, stage_to_rank=one_rank)
    assert list(program) == [0] and len(program[0]) == 2 * 4 * 4


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for p, m in [(1, 1), (3, 4), (4, 2)]:
        assert generate("interleaved", p, m) == generate("1f1b", p, m)
        assert generate("interleaved", p, m, num_virtual_stages=1, forward_only=True) == (
            generate("1f1b", p, m, forward_only=True)
        )


def test_interleaved_forward_only() -> None:
    assert lines(generate("interleaved", 4, 2, num_virtual_stages=2, forward_only=True)) == [
        "rank 0: 0F0 0SF0 0F1 0SF1 2RF0 2F0 2SF0 2RF1 2F1 2SF1",
        "rank 1: 1RF0 1F0 1SF0 1RF1 1F1 1SF1 3RF0 3F0 3RF1 3F1",
    ]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1"])
def test_virtual_stages_need_the_interleaved_schedule(name: str) -> None:
    with pytest.raises(ScheduleError, match=f"schedule '{name}' runs one stage per rank, but "
                       "num_virtual_stages=2; use schedule='interleaved'"):
        generate(name, 4, 4, num_virtual_stages=2)
    with pytest.raises(ScheduleError, match="use schedule='interleaved'"):
        generate(name, 4, 4, num_virtual_stages=2, forward_only=True)


def test_interleaved_stage_count_must_divide() -> None:
    with pytest.raises(ScheduleError, match=r"num_chunks=6 is not a multiple of "
                       r"num_virtual_stages=4: .* pass num_chunks = p \* v \(e.g. 4 or 8\)"):
        generate("interleaved", 6, 4, num_virtual_stages=4)
    with pytest.raises(ScheduleError, match="num_virtual_stages must be an int >= 1, got 0"):
        generate("interleaved", 4, 4, num_virtual_stages=0)


def test_splits_backward() -> None:
    assert splits_backward(generate("zbh1", 3, 4))
    assert splits_backward(zbh1(1, 1))
    for name in ("gpipe", "1f1b", "interleaved"):
        assert not splits_backward(generate(name, 4, 4))
    assert not splits_backward(generate("zbh1", 3, 4, forward_only=True))
    assert not splits_backward({})
