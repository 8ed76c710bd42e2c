"""Schedule generators: per-rank lists of F and B actions for GPipe, 1F1B and inference.

Both training schedules come from one function, `_stage_order`: a stage runs `num_warmup`
forwards, then alternates one forward and one backward while forwards remain, then runs the
backwards that are left. GPipe is the case num_warmup = m; 1F1B (PipeDream-Flush, DAPPLE) is
num_warmup = min(p - s - 1, m) on stage s. Stage s lives on rank s until `generate` places it.

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
"""

from __future__ import annotations

from collections.abc import Callable

from plait.errors import ScheduleError
from plait.schedule.action import Action, Op, Program
from plait.schedule.lower import check_sizes, lower_communication, place_stages
from plait.schedule.validate import validate

__all__ = ["gpipe", "one_f_one_b", "forward_only", "SCHEDULES", "generate"]


def _stage_order(stage_index: int, num_microbatches: int, num_warmup: int) -> list[Action]:
    """Warmup forwards, then (F, B) pairs while forwards remain, then the remaining backwards."""
    forwards = [Action(stage_index, Op.FORWARD, k) for k in range(num_microbatches)]
    backwards = [Action(stage_index, Op.BACKWARD, k) for k in range(num_microbatches)]
    order = forwards[:num_warmup]
    for k in range(num_warmup, num_microbatches):
        order += [forwards[k], backwards[k - num_warmup]]
    order += backwards[num_microbatches - num_warmup:]
    return order


def gpipe(num_stages: int, num_microbatches: int) -> Program:
    """GPipe (Huang et al. 2019): each stage runs F0..F(m-1), then B0..B(m-1).

    Backwards run in ascending micro-batch order (B0 first), the order in which the last stage
    finished the forwards, so every stage pops activations first-in first-out.
    """
    check_sizes(num_stages, num_microbatches)
    return {s: _stage_order(s, num_microbatches, num_microbatches) for s in range(num_stages)}


def one_f_one_b(num_stages: int, num_microbatches: int) -> Program:
    """1F1B, i.e. PipeDream-Flush (Narayanan et al. 2021) or DAPPLE (Fan et al. 2021).

    Stage s runs min(p - s - 1, m) warmup forwards, then alternates F then B while forwards
    remain, then the cooldown backwards, all in ascending micro-batch order.
    """
    check_sizes(num_stages, num_microbatches)
    return {
        s: _stage_order(s, num_microbatches, min(num_stages - s - 1, num_microbatches))
        for s in range(num_stages)
    }


def forward_only(num_stages: int, num_microbatches: int) -> Program:
    """Inference (evaluate, predict): each stage runs F0..F(m-1) and no backward."""
    check_sizes(num_stages, num_microbatches)
    return {
        s: [Action(s, Op.FORWARD, k) for k in range(num_microbatches)]
        for s in range(num_stages)
    }


SCHEDULES: dict[str, Callable[[int, int], Program]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
"""Schedule name (as written in a config) -> generator of its compute-only program."""

_forward_only = forward_only  # `generate` takes a keyword of the same name


def generate(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    stage_to_rank: dict[int, int] | None = None,
) -> Program:
    """The runnable program of schedule `name`: generated, placed, lowered and validated.

    `forward_only=True` gives the inference program (no backward) whatever the name, but the
    name must still be known. `stage_to_rank` (default: stage s on rank s) may put several
    stages on one rank; their actions are then merged in clock-cycle order (`place_stages`)
    and the hand-overs between them are local, so no SF/RF or SB/RB is inserted for them.
    """
    if name not in SCHEDULES:
        raise ScheduleError(
            f"unknown schedule {name!r}; known schedules: {', '.join(sorted(SCHEDULES))}"
        )
    make = _forward_only if forward_only else SCHEDULES[name]
    compute = make(num_stages, num_microbatches)
    placed = place_stages(compute, num_stages, stage_to_rank)
    program = lower_communication(placed, num_stages, stage_to_rank)
    validate(program, num_stages, num_microbatches, stage_to_rank, forward_only=forward_only)
    return program
