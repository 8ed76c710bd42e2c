"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v non-adjacent stages on each rank.

The model is cut into S = p * v stages; stage s lives on pipeline position s % p, so position r
holds stages r, r + p, r + 2p, ... (its v "chunks"; stage s is chunk s // p of its rank). The
program is keyed by position 0..p-1. Every rank walks the same table of (micro-batch, chunk)
pairs (`microbatch_table`): micro-batches in groups of p, each group through chunk 0, then
chunk 1, ..., then the next group. Forwards follow the table; backwards follow it with the
chunks reversed (the last chunk's gradient comes first). Rank r runs 2(p - r - 1) + (v - 1)p
warmup forwards, then alternates one forward and one backward, then the cooldown backwards;
when m = p every forward comes first, as in Megatron.

Clock cycles for p = 2 ranks, v = 2 chunks (stages 0..3) and m = 4 micro-batches when every
chunk's F and B take one cycle (a test keeps these pictures in step with the code):

    clock  |  0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17
    rank 0 | 0F0  0F1  2F0  2F1  0F2  2B0  0F3  2B1  2F2  0B0  2F3  0B1       2B2       2B3  0B2  0B3
    rank 1 |      1F0  1F1  3F0  3B0  3F1  3B1  1F2  1B0  1F3  1B1  3F2  3B2  3F3  3B3  1B2  1B3

With m a multiple of p this is Megatron's order: the bubble is (p - 1)(t_f + t_b) / v, a v-th
of 1F1B's (above: 2 idle cycles per rank in 18, where 1F1B on 2 ranks, each F and B of a
whole rank taking 2 cycles, idles 4 in 20), and once m >= 2p rank 0 holds at most
p(1 + (p - 1)/(p v)) micro-batches' worth of activations (a chunk's activations count 1/v).

Megatron requires m to be a multiple of p; here any m >= 1 works. The last full group also
takes the m mod p micro-batches left over (`group_sizes`: 11 on 4 ranks -> [4, 7]; m < p: one
group of m), and the warmup grows to 2(p - r - 1) + (v - 1)G for the largest group size G:
the backward table puts a micro-batch's last-chunk B where its chunk-0 F is, and the last
rank must have run that micro-batch's last-chunk F, (v - 1)G entries later, by then. (A short
last group after full ones instead deadlocks: rank 0 waits on a chunk hand-over from rank
p - 1 while rank p - 1 waits on rank 0's gradient; a test keeps that story.) The dry run finds
every such program valid (tests sweep p, v and m). For p = 2, v = 2, m = 3 (one group of 3):

    clock  |  0    1    2    3    4    5    6    7    8    9    10   11   12   13
    rank 0 | 0F0  0F1  0F2  2F0  2F1  2F2  2B0       2B1       2B2  0B0  0B1  0B2
    rank 1 |      1F0  1F1  1F2  3F0  3B0  3F1  3B1  3F2  3B2  1B0  1B1  1B2
"""

from __future__ import annotations

from plait.errors import ScheduleError
from plait.schedule.action import Action, Op, Program
from plait.schedule.generators import one_f_one_b, order_1f1b
from plait.schedule.lower import check_sizes

__all__ = ["interleaved", "microbatch_table", "group_sizes"]


def group_sizes(num_microbatches: int, num_ranks: int) -> list[int]:
    """Micro-batches per group: p each, the last one also takes the m mod p left over (m < p:
    one group of m). `group_sizes(11, 4)` is [4, 7]."""
    sizes = [num_ranks] * (num_microbatches // num_ranks) or [0]
    sizes[-1] += num_microbatches % num_ranks
    return sizes


def microbatch_table(
    num_microbatches: int, num_ranks: int, num_chunks: int
) -> list[tuple[int, int]]:
    """The (micro-batch, chunk) pairs in the order every rank runs their forwards.

    Groups of micro-batches (`group_sizes`), each run through chunk 0, 1, ..., v-1.
    `microbatch_table(4, 2, 2)` is [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1),
    (3, 1)]; `microbatch_table(3, 2, 2)` is [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)].
    """
    table: list[tuple[int, int]] = []
    first = 0
    for size in group_sizes(num_microbatches, num_ranks):
        table += [(k, chunk) for chunk in range(num_chunks) for k in range(first, first + size)]
        first += size
    return table


def interleaved(
    num_chunks: int, num_microbatches: int, num_virtual_stages: int, *, forward_only: bool = False
) -> Program:
    """Interleaved 1F1B of S = `num_chunks` stages, `num_virtual_stages` (v) on each of p ranks.

    Keyed by pipeline position r = 0..p-1, which holds stages r, r + p, ...; v = 1 is 1F1B.
    `forward_only=True` gives the inference order: every forward of the table, no backward.
    """
    check_sizes(num_chunks, num_microbatches)
    v = num_virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ScheduleError(f"num_virtual_stages must be an int >= 1, got {v!r}")
    if num_chunks % v:
        raise ScheduleError(
            f"num_chunks={num_chunks} is not a multiple of num_virtual_stages={v}: interleaved "
            f"1F1B puts v stages on each of p = num_chunks / v ranks; pass num_chunks = p * v "
            f"(e.g. {v * max(1, num_chunks // v)} or {v * (num_chunks // v + 1)})"
        )
    p = num_chunks // v
    if v == 1 and not forward_only:
        return one_f_one_b(num_chunks, num_microbatches)
    table = microbatch_table(num_microbatches, p, v)
    largest_group = max(group_sizes(num_microbatches, p))
    program: Program = {}
    for r in range(p):
        forwards = [Action(chunk * p + r, Op.FORWARD, k) for k, chunk in table]
        if forward_only:
            program[r] = forwards
            continue
        backwards = [Action((v - 1 - chunk) * p + r, Op.BACKWARD, k) for k, chunk in table]
        num_warmup = 2 * (p - r - 1) + (v - 1) * largest_group
        if num_microbatches == p:  # Megatron: all forwards first when m == p
            num_warmup = len(table)
        program[r] = order_1f1b(forwards, backwards, min(num_warmup, len(table)))
    return program
