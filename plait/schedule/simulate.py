"""Event simulation of a named schedule with given costs: step time, bubble, memory and timeline.

It times the very program the runtime runs (`generate`, with its sends and receives dropped:
a hand-over between ranks costs `t_comm` instead) with `timing.time_actions`, the timing model
behind `clock_cycles` too. Times are exact fractions inside and floats outside, so integer
costs reproduce the closed forms of GPipe, 1F1B, interleaved 1F1B and ZB-H1 exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from plait.errors import ScheduleError
from plait.schedule.action import COMPUTE_OPS, Action, Op, Program
from plait.schedule.lower import check_sizes
from plait.schedule.registry import generate, splits_backward
from plait.schedule.timing import time_actions

__all__ = ["Event", "Simulation", "simulate"]


@dataclass(frozen=True)
class Event:
    """One compute action on the timeline: `op` ("F", "B" or "W") of a stage and micro-batch."""

    rank: int
    stage_index: int
    op: str
    microbatch_index: int
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What one training step of a schedule costs.

    `bubble_fraction` is the idle share of all ranks' time, 1 - sum(busy) / (p * step_time).
    `peak_activations[r]` is the most micro-batches whose activations rank r holds at once:
    forward done, backward (B, or W when the backward is split) not yet; one chunk of an
    interleaved rank counts 1/v.
    """

    step_time: float
    bubble_fraction: float
    peak_activations: list[float]
    timeline: list[Event]


def _cost(name: str, value: object) -> Fraction:
    """`value` checked to be a finite number >= 0, as an exact fraction."""
    if (
        isinstance(value, bool) or not isinstance(value, (int, float, Fraction))
        or not math.isfinite(value) or value < 0
    ):
        raise ScheduleError(f"{name} must be a finite number >= 0 (a time), got {value!r}")
    return Fraction(value)


def _stage_costs(
    name: str, value: float | Sequence[float], num_ranks: int, v: int
) -> list[Fraction]:
    """Cost of each of the p * v chunks: a rank's cost (one number, or one per rank) split
    evenly over its v chunks, or one number per chunk given in stage order."""
    num_chunks = num_ranks * v
    if isinstance(value, str) or not isinstance(value, Sequence):
        return [_cost(name, value) / v] * num_chunks
    if len(value) == num_chunks:  # one per chunk; with v = 1 also one per rank
        return [_cost(f"{name}[{s}]", value[s]) for s in range(num_chunks)]
    if len(value) == num_ranks:
        return [_cost(f"{name}[{s % num_ranks}]", value[s % num_ranks]) / v
                for s in range(num_chunks)]
    per_chunk = f" or {num_chunks} (one per chunk, in stage order)" if v > 1 else ""
    raise ScheduleError(
        f"{name} has {len(value)} entries, but the pipeline has {num_ranks} stages; give one "
        f"number, or a list of {num_ranks} (one per pipeline stage){per_chunk}"
    )


def _compute_only(program: Program) -> Program:
    return {r: [a for a in actions if a.op in COMPUTE_OPS] for r, actions in program.items()}


def simulate(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    t_f: float | Sequence[float],
    t_b: float | Sequence[float],
    t_w: float | Sequence[float] = 0.0,
    t_comm: float = 0.0,
    num_virtual_stages: int = 1,
) -> Simulation:
    """Simulate one step of `schedule` on `num_stages` (p) pipeline ranks.

    `t_f`, `t_b`, `t_w`: forward, input-gradient and weight-gradient time of one micro-batch
    on one pipeline stage, one number or a list of p; with `num_virtual_stages` v > 1 each
    chunk takes 1/v of its rank's time, or give a list of p * v per-chunk times (stage order:
    chunk c of rank r is stage c * p + r). Schedules that do not split the backward run B and
    W back to back: their B costs t_b + t_w. `t_comm` is added to every hand-over of an
    activation or gradient between different ranks. Each rank runs its list in order; an
    action starts when its rank is free and its inputs have arrived.

    For uniform costs and t_w = 0, GPipe and 1F1B take (m + p - 1)(t_f + t_b)
    (Narayanan et al. 2021, section 2.2: m(t_f + t_b) of work and a (p - 1)(t_f + t_b) bubble).
    (Eight parameters, beyond the house limit of six: they are the cost model's own inputs,
    named as in the papers, and the last four have defaults.)
    """
    check_sizes(num_stages, num_microbatches, "num_stages")
    v = num_virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ScheduleError(f"num_virtual_stages must be an int >= 1, got {v!r}")
    forward, backward, weight = (
        _stage_costs(name, value, num_stages, v)
        for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w))
    )
    transfer = _cost("t_comm", t_comm)
    program = _compute_only(
        generate(schedule, num_stages * v, num_microbatches, num_virtual_stages=v)
    )
    split = splits_backward(program)

    def duration(action: Action) -> Fraction:
        s = action.stage_index
        if action.op is Op.FORWARD:
            return forward[s]
        if action.op is Op.WEIGHT:
            return weight[s]
        return backward[s] + (0 if split else weight[s])

    times = time_actions(program, num_stages * v, duration, transfer)
    step = max((end for _, end in times.values()), default=Fraction(0))
    busy = sum((end - start for start, end in times.values()), Fraction(0))
    idle = 1 - busy / (num_stages * step) if step > 0 else Fraction(0)
    release = Op.WEIGHT if split else Op.BACKWARD
    peaks: list[float] = []
    for rank in range(num_stages):
        held, peak = Fraction(0), Fraction(0)
        for action in program.get(rank, []):  # a rank runs its list in time order
            held += Fraction(1, v) if action.op is Op.FORWARD else 0
            held -= Fraction(1, v) if action.op is release else 0
            peak = max(peak, held)
        peaks.append(float(peak))
    timeline = sorted(
        (Event(rank, a.stage_index, a.op.value, a.microbatch_index,
               float(times[a][0]), float(times[a][1]))
         for rank, actions in program.items() for a in actions),
        key=lambda e: (e.start, e.rank, e.end),
    )
    return Simulation(float(step), float(idle), peaks, timeline)
