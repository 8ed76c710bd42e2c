"""Schedule generators with one stage per rank: GPipe, 1F1B, ZB-H1 and inference.

Every training schedule comes from one function, `order_1f1b`: a stage runs `num_warmup`
forwards, then alternates one forward and one backward while forwards remain, then runs the
backwards that are left. GPipe is the case num_warmup = m; 1F1B (PipeDream-Flush, DAPPLE) is
num_warmup = min(p - s - 1, m) on stage s; ZB-H1 is 1F1B with each backward split in two;
interleaved 1F1B (`interleaved.py`) runs it over several stages per rank. Stage s lives on
rank s until `generate` places it.

Clock cycles for p = 3 stages and m = 4 micro-batches when an F and a B each take one cycle
(drawn by `timing.format_timeline`; a test keeps these pictures in step with the code):

GPipe: every stage holds all m activations before its first backward.

    clock  |  0    1    2    3    4    5    6    7    8    9    10   11
    rank 0 | 0F0  0F1  0F2  0F3                      0B0  0B1  0B2  0B3
    rank 1 |      1F0  1F1  1F2  1F3            1B0  1B1  1B2  1B3
    rank 2 |           2F0  2F1  2F2  2F3  2B0  2B1  2B2  2B3

1F1B: stage s holds at most min(p - s, m) activations, so stage 0 peaks at min(p, m), not m;
the step is just as long (2(m + p - 1) cycles), the bubble is the same.

    clock  |  0    1    2    3    4    5    6    7    8    9    10   11
    rank 0 | 0F0  0F1  0F2            0B0  0F3  0B1       0B2       0B3
    rank 1 |      1F0  1F1       1B0  1F2  1B1  1F3  1B2       1B3
    rank 2 |           2F0  2B0  2F1  2B1  2F2  2B2  2F3  2B3

ZB-H1 (Qi et al. 2023): B is only the input gradient and W (one cycle too) the weight
gradient; stage s runs W(k) after B(k + s) and the rest at the end, so each stage still holds
at most p micro-batches (F done, W not yet) while the W passes fill 1F1B's cooldown bubbles:
the step is 3m + p - 1 cycles, p - 1 of them idle, against 1F1B's 3(p - 1) when its backward
(B and W together) takes two cycles.

    clock  |  0    1    2    3    4    5    6    7    8    9    10   11   12   13
    rank 0 | 0F0  0F1  0F2            0B0  0W0  0F3  0B1  0W1  0B2  0W2  0B3  0W3
    rank 1 |      1F0  1F1       1B0  1F2  1B1  1W0  1F3  1B2  1W1  1B3  1W2  1W3
    rank 2 |           2F0  2B0  2F1  2B1  2F2  2B2  2W0  2F3  2B3  2W1  2W2  2W3
"""

from __future__ import annotations

from plait.schedule.action import Action, Op, Program
from plait.schedule.lower import check_sizes

__all__ = ["gpipe", "one_f_one_b", "zbh1", "forward_only", "order_1f1b"]


def order_1f1b(forwards: list[Action], backwards: list[Action], num_warmup: int) -> list[Action]:
    """Warmup forwards, then (F, B) pairs while forwards remain, then the remaining backwards."""
    order = forwards[:num_warmup]
    for k in range(num_warmup, len(forwards)):
        order += [forwards[k], backwards[k - num_warmup]]
    order += backwards[len(forwards) - num_warmup:]
    return order


def _stage_order(stage_index: int, num_microbatches: int, num_warmup: int) -> list[Action]:
    """`order_1f1b` of one stage's F0..F(m-1) and B0..B(m-1)."""
    forwards = [Action(stage_index, Op.FORWARD, k) for k in range(num_microbatches)]
    backwards = [Action(stage_index, Op.BACKWARD, k) for k in range(num_microbatches)]
    return order_1f1b(forwards, backwards, num_warmup)


def gpipe(num_stages: int, num_microbatches: int) -> Program:
    """GPipe (Huang et al. 2019): each stage runs F0..F(m-1), then B0..B(m-1).

    Backwards run in ascending micro-batch order (B0 first), the order in which the last stage
    finished the forwards, so every stage pops activations first-in first-out.
    """
    check_sizes(num_stages, num_microbatches, "num_stages")
    return {s: _stage_order(s, num_microbatches, num_microbatches) for s in range(num_stages)}


def one_f_one_b(num_stages: int, num_microbatches: int) -> Program:
    """1F1B, i.e. PipeDream-Flush (Narayanan et al. 2021) or DAPPLE (Fan et al. 2021).

    Stage s runs min(p - s - 1, m) warmup forwards, then alternates F then B while forwards
    remain, then the cooldown backwards, all in ascending micro-batch order.
    """
    check_sizes(num_stages, num_microbatches, "num_stages")
    return {
        s: _stage_order(s, num_microbatches, min(num_stages - s - 1, num_microbatches))
        for s in range(num_stages)
    }


def zbh1(num_stages: int, num_microbatches: int) -> Program:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Fig. 3): 1F1B with split B / W.

    Stage s runs 1F1B's F and B order (B is now the input gradient only) and puts W(k) right
    after B(k + s); the s weight-gradient passes left at the end close its cooldown. Stage s
    so holds at most min(p, m) micro-batches (an F not yet followed by its W), as 1F1B's stage 0
    does, and fills the cooldown bubbles of 1F1B with W: the bubble drops from
    (p-1)(t_f + t_b + t_w) to (p-1)(t_f + t_b - t_w), a third when all three are equal.
    """
    check_sizes(num_stages, num_microbatches, "num_stages")
    program: Program = {}
    for s in range(num_stages):
        order: list[Action] = []
        for action in _stage_order(s, num_microbatches, min(num_stages - s - 1, num_microbatches)):
            order.append(action)
            if action.op is Op.BACKWARD and action.microbatch_index >= s:
                order.append(Action(s, Op.WEIGHT, action.microbatch_index - s))
        left = range(max(num_microbatches - s, 0), num_microbatches)
        program[s] = order + [Action(s, Op.WEIGHT, k) for k in left]
    return program


def forward_only(num_stages: int, num_microbatches: int) -> Program:
    """Inference (evaluate, predict): each stage runs F0..F(m-1) and no backward."""
    check_sizes(num_stages, num_microbatches, "num_stages")
    return {
        s: [Action(s, Op.FORWARD, k) for k in range(num_microbatches)]
        for s in range(num_stages)
    }
