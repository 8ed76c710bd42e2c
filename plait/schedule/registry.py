"""Schedules by name, and `generate`: a named schedule's program, placed, lowered and validated."""

from __future__ import annotations

from collections.abc import Callable

from plait.errors import ScheduleError
from plait.schedule.action import Op, Program
from plait.schedule.generators import forward_only as forward_only_program
from plait.schedule.generators import gpipe, one_f_one_b, zbh1
from plait.schedule.interleaved import interleaved
from plait.schedule.lower import check_sizes, lower_communication, place_stages
from plait.schedule.validate import validate

__all__ = ["SCHEDULES", "generate", "splits_backward"]

SCHEDULES: dict[str, Callable[..., Program]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zbh1": zbh1,
}
"""Schedule name -> generator of its compute-only program: one generator for each name of
`plait.config.SCHEDULE_NAMES`, the one list of schedule names (tests/schedule/test_registry.py
checks they agree; this package imports nothing of plait but its errors).

Each takes (num_chunks, num_microbatches); "interleaved" also takes num_virtual_stages.
"""


def _compute_program(
    name: str, num_chunks: int, num_microbatches: int, forward_only: bool, num_virtual_stages: int
) -> tuple[Program, dict[int, int] | None]:
    """The generator's program (keyed by pipeline position) and its default stage_to_rank."""
    if name not in SCHEDULES:
        raise ScheduleError(
            f"unknown schedule {name!r}; known schedules: {', '.join(sorted(SCHEDULES))}"
        )
    if name == "interleaved":
        program = interleaved(
            num_chunks, num_microbatches, num_virtual_stages, forward_only=forward_only
        )
        p = num_chunks // num_virtual_stages
        return program, {s: s % p for s in range(num_chunks)}
    if num_virtual_stages != 1:
        raise ScheduleError(
            f"schedule {name!r} runs one stage per rank, but num_virtual_stages="
            f"{num_virtual_stages!r}; use schedule='interleaved' for several stages per rank, "
            f"or num_virtual_stages=1"
        )
    make = forward_only_program if forward_only else SCHEDULES[name]
    return make(num_chunks, num_microbatches), None


def generate(
    name: str,
    num_chunks: int,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    stage_to_rank: dict[int, int] | None = None,
    num_virtual_stages: int = 1,
) -> Program:
    """The runnable program of schedule `name`: generated, placed, lowered and validated.

    `num_chunks` counts model chunks (stages of the model): with "interleaved" that is S = p * v for p pipeline
    ranks of `num_virtual_stages` (v) stages each, stage s on rank s % p unless `stage_to_rank`
    says otherwise; every other schedule has v = 1 and stage s on rank s by default.
    `forward_only=True` gives the inference program (no backward) whatever the name, but the
    name must still be known. `stage_to_rank` may put several stages on one rank; their
    actions are then merged in clock-cycle order (`place_stages`) and the hand-overs between
    them are local, so no SF/RF or SB/RB is inserted for them.
    """
    check_sizes(num_chunks, num_microbatches)
    compute, default_ranks = _compute_program(
        name, num_chunks, num_microbatches, forward_only, num_virtual_stages
    )
    ranks = default_ranks if stage_to_rank is None else stage_to_rank
    placed = place_stages(compute, num_chunks, ranks)
    program = lower_communication(placed, num_chunks, ranks)
    validate(program, num_chunks, num_microbatches, ranks, forward_only=forward_only)
    return program


def splits_backward(program: Program) -> bool:
    """True if `program` splits the backward into B (input gradient) and W (weight gradient)."""
    return any(action.op is Op.WEIGHT for actions in program.values() for action in actions)
