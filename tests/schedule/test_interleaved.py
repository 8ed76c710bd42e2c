"""Tests of interleaved 1F1B: Megatron's order, any micro-batch count, pictures, closed forms."""

from __future__ import annotations

import importlib

import pytest

from plait.errors import ScheduleError
from plait.schedule import (
    Action, Op, Program, format_program, generate, interleaved, lower_communication,
    one_f_one_b, validate,
)
from plait.schedule.generators import order_1f1b
from plait.schedule.interleaved import group_sizes, microbatch_table
from plait.schedule.timing import clock_cycles, format_timeline

MODULE = importlib.import_module("plait.schedule.interleaved")  # the package exports the function


def megatron_order(p: int, m: int, v: int, rank: int) -> list[Action]:
    """Megatron-LM's `forward_backward_pipelining_with_interleaving` (2021), transcribed.

    The k-th forward of a rank runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p;
    the k-th backward runs chunk v - 1 - (k // p) % v on the same micro-batch; warmup is
    2(p - rank - 1) + (v - 1)p forwards (all of them when m = p). Needs m % p == 0.
    """
    assert m % p == 0
    total = m * v

    def chunk_and_microbatch(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    def f(k: int) -> Action:
        chunk, mb = chunk_and_microbatch(k, True)
        return Action(chunk * p + rank, Op.FORWARD, mb)

    def b(k: int) -> Action:
        chunk, mb = chunk_and_microbatch(k, False)
        return Action(chunk * p + rank, Op.BACKWARD, mb)

    warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [f(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [f(k + warmup), b(k)]
    return order + [b(k) for k in range(total - warmup, total)]


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("v", range(2, 5))
@pytest.mark.parametrize("groups", range(1, 4))
def test_megatron_order_when_m_is_a_multiple_of_p(p: int, v: int, groups: int) -> None:
    m = groups * p
    program = interleaved(p * v, m, v)
    assert sorted(program) == list(range(p))
    for rank in range(p):
        assert program[rank] == megatron_order(p, m, v, rank)


def test_group_sizes_and_table() -> None:
    assert group_sizes(8, 4) == [4, 4]
    assert group_sizes(11, 4) == [4, 7]  # the last group takes the 3 left over
    assert group_sizes(3, 4) == [3]
    assert group_sizes(1, 1) == [1]
    assert microbatch_table(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0),
                                         (2, 1), (3, 1)]
    assert microbatch_table(3, 2, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    for m in range(1, 12):
        for p in range(1, 5):
            assert sum(group_sizes(m, p)) == m
            assert sorted(microbatch_table(m, p, 3)) == [(k, c) for k in range(m) for c in range(3)]


def test_exact_small_cases() -> None:
    assert format_program(interleaved(4, 3, 2)).splitlines() == [
        "rank 0: 0F0 0F1 0F2 2F0 2F1 2F2 2B0 2B1 2B2 0B0 0B1 0B2",
        "rank 1: 1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1B0 1B1 1B2",
    ]
    assert interleaved(3, 2, 1) == one_f_one_b(3, 2)
    assert format_program(interleaved(4, 2, 2, forward_only=True)).splitlines() == [
        "rank 0: 0F0 0F1 2F0 2F1", "rank 1: 1F0 1F1 3F0 3F1",
    ]


def test_module_pictures_match_the_code() -> None:
    doc = MODULE.__doc__
    assert doc is not None
    for m in (4, 3):  # p = 2, v = 2
        for line in format_timeline(interleaved(4, m, 2), 4).splitlines():
            assert f"    {line}\n" in doc


def peak_chunks(program: Program, rank: int) -> int:
    held, peak = 0, 0
    for action in program[rank]:
        held += {Op.FORWARD: 1, Op.BACKWARD: -1}.get(action.op, 0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("v", range(1, 5))
@pytest.mark.parametrize("groups", range(1, 5))
def test_closed_forms_when_m_is_a_multiple_of_p(p: int, v: int, groups: int) -> None:
    # Narayanan et al. 2021 (interleaved 1F1B): bubble / ideal = (1/v)(p - 1)/m; with one cycle per
    # chunk's F and B the ideal is 2 m v cycles, so the bubble is 2(p - 1) cycles on each rank
    m = groups * p
    program = interleaved(p * v, m, v)
    start = clock_cycles(program, p * v)
    step = max(start.values()) + 1
    assert step - 2 * m * v == 2 * (p - 1)
    # Narayanan et al. 2021: rank 0 holds p(1 + (p - 1)/(p v)) micro-batches = p v + p - 1 chunks, once
    # there are that many (m = p runs every forward first: all m v chunks)
    expected = min(m * v, p * v + p - 1) if v > 1 else min(p, m)
    assert peak_chunks(program, 0) == expected


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("v", range(1, 5))
def test_any_microbatch_count_is_valid(p: int, v: int) -> None:
    # Megatron needs m % p == 0; this generator takes any m, and the dry run inside
    # `generate` (validate) proves each program complete and free of deadlock
    for m in range(1, 3 * p + 3):
        generate("interleaved", p * v, m, num_virtual_stages=v)
        generate("interleaved", p * v, m, num_virtual_stages=v, forward_only=True)
        # never slower than 1F1B on the same ranks with whole-rank costs (v cycles per F or B)
        step = max(clock_cycles(interleaved(p * v, m, v), p * v).values()) + 1
        assert step <= 2 * v * (m + p - 1)


def test_short_last_group_would_deadlock() -> None:
    # the story of the remainder rule. m = 5 on p = 4 ranks, v = 3: cutting the micro-batches
    # Megatron's way into groups [4, 1], with its warmup, deadlocks (rank 0 waits for a chunk
    # hand-over from rank 3, which waits for a gradient that needs rank 0); the leftover
    # micro-batch joins the last full group instead, and the warmup grows with that group
    p, v, m = 4, 3, 5
    table = [(k, c) for c in range(v) for k in range(4)] + [(4, c) for c in range(v)]
    short_groups: dict[int, list[Action]] = {}
    for r in range(p):
        forwards = [Action(c * p + r, Op.FORWARD, k) for k, c in table]
        backwards = [Action((v - 1 - c) * p + r, Op.BACKWARD, k) for k, c in table]
        short_groups[r] = order_1f1b(forwards, backwards, 2 * (p - r - 1) + (v - 1) * p)
    ranks = {s: s % p for s in range(p * v)}
    with pytest.raises(ScheduleError, match="deadlock: no rank can progress"):
        validate(lower_communication(short_groups, p * v, ranks), p * v, m, ranks)
    assert group_sizes(m, p) == [5]
    generate("interleaved", p * v, m, num_virtual_stages=v)


def test_bad_arguments() -> None:
    with pytest.raises(ScheduleError, match="num_chunks=5 is not a multiple of "
                       "num_virtual_stages=2"):
        interleaved(5, 4, 2)
    with pytest.raises(ScheduleError, match="num_virtual_stages must be an int >= 1, got True"):
        interleaved(4, 4, True)
    with pytest.raises(ScheduleError, match="num_microbatches must be an int >= 1, got 0"):
        interleaved(4, 0, 2)
