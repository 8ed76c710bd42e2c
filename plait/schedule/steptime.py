"""Fast float timing of a schedule's step for the planner, on precompiled action tables.

`simulate` times the validated, lowered program with exact fractions: right for a chart, too
slow for a planner that times hundreds of layouts of up to 64 stages x 1024 micro-batches. This
module applies the same rule as `timing.time_actions` -- each rank runs its list in order; an
action starts when its rank is free and every action it needs has ended, plus the hand-over
time when that action ran on another rank -- to the generator's compute-only program,
compiled once per (schedule, ranks, micro-batches, chunks) into integer tables and timed in
floats. Two additions for the cost model: the hand-over time may differ per stage boundary
(a cut's activation bytes over its link), and each rank reports when its last gradient pass
began (the data-parallel all-reduce overlaps that pass). A test keeps it equal to `simulate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from plait.errors import ScheduleError
from plait.schedule.action import Op
from plait.schedule.lower import check_sizes
from plait.schedule.registry import compute_program, schedule_spec
from plait.schedule.spec import ScheduleSpec

__all__ = ["CompiledSchedule", "StepTime", "compile_schedule", "time_step"]

_OPS = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.WEIGHT: 2}
# One row per action of a rank: (action id, kind 0/1/2 = F/B/W, stage, first need or -1,
# its boundary or -1 when local, second need or -1, its boundary or -1 when local).
Row = tuple[int, int, int, int, int, int, int]


@dataclass(frozen=True)
class CompiledSchedule:
    """A schedule's per-rank action order as integer rows, and what it holds in memory.

    `peak_activations[r]`: most micro-batches whose activations rank r holds at once (an F
    done, its B -- or W when the backward is split -- not yet; a chunk counts 1/v), as
    `Simulation.peak_activations`.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    num_virtual_stages: int
    splits_backward: bool
    rows: tuple[tuple[Row, ...], ...]
    peak_activations: tuple[float, ...]

    @property
    def num_chunks(self) -> int:
        return self.num_ranks * self.num_virtual_stages


@dataclass(frozen=True)
class StepTime:
    """One step's pipeline timing: its length, and per rank its end and last gradient pass."""

    step_time: float
    rank_end: tuple[float, ...]
    last_grad_start: tuple[float, ...]  # start of the rank's last B (W when split)


def compile_schedule(
    name: str, num_ranks: int, num_microbatches: int, num_virtual_stages: int = 1
) -> CompiledSchedule:
    """The integer tables of schedule `name` on `num_ranks` ranks (stage s on rank s % p)."""
    check_sizes(num_ranks, num_microbatches, "num_ranks")
    return _compile(schedule_spec(name), num_ranks, num_microbatches, num_virtual_stages)


@lru_cache(maxsize=16)  # a 64-stage x 1024 micro-batch table holds ~10 MB; keyed by the spec, not its name
def _compile(spec: ScheduleSpec, num_ranks: int, num_microbatches: int, num_virtual_stages: int) -> CompiledSchedule:
    name, p, m, v = spec.name, num_ranks, num_microbatches, num_virtual_stages
    program = compute_program(name, p * v, m, num_virtual_stages=v)[0]
    stages = p * v
    split = any(a.op is Op.WEIGHT for actions in program.values() for a in actions)

    def ident(kind: int, s: int, k: int) -> int:
        return (kind * stages + s) * m + k

    rows: list[tuple[Row, ...]] = []
    peaks: list[float] = []
    release = Op.WEIGHT if split else Op.BACKWARD
    for rank in range(p):
        table: list[Row] = []
        held = peak = 0  # in chunks: 1/v of a micro-batch each
        for a in program.get(rank, []):
            s, k, kind = a.stage_index, a.microbatch_index, _OPS[a.op]
            n1 = c1 = n2 = c2 = -1
            if a.op is Op.FORWARD and s > 0:
                n1, c1 = ident(0, s - 1, k), (s - 1 if (s - 1) % p != rank else -1)
            elif a.op is Op.BACKWARD:
                n1 = ident(0, s, k)
                if s < stages - 1:
                    n2, c2 = ident(1, s + 1, k), (s if (s + 1) % p != rank else -1)
            elif a.op is Op.WEIGHT:
                n1 = ident(1, s, k)
            table.append((ident(kind, s, k), kind, s, n1, c1, n2, c2))
            held += 1 if a.op is Op.FORWARD else 0
            held -= 1 if a.op is release else 0
            peak = max(peak, held)
        rows.append(tuple(table))
        peaks.append(peak / v)
    return CompiledSchedule(name, p, m, v, split, tuple(rows), tuple(peaks))


def _per_stage(name: str, value: float | Sequence[float], count: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * count
    if len(value) != count:
        raise ScheduleError(f"{name} has {len(value)} entries; give one number or {count}")
    return [float(x) for x in value]


def time_step(
    compiled: CompiledSchedule,
    t_f: float | Sequence[float],
    t_b: float | Sequence[float],
    t_w: float | Sequence[float] = 0.0,
    t_comm: float | Sequence[float] = 0.0,
) -> StepTime:
    """Time one step: per-stage costs (p x v entries, stage order), per-boundary hand-overs.

    `t_comm` is one number or one per boundary (stage s -> s + 1, S - 1 entries), paid by a
    forward or backward hand-over across it when the two stages sit on different ranks. A
    schedule that does not split the backward runs W inside B (its B costs t_b + t_w).
    """
    stages = compiled.num_chunks
    f = _per_stage("t_f", t_f, stages)
    w = _per_stage("t_w", t_w, stages)
    b = [x + (0.0 if compiled.splits_backward else y) for x, y in zip(_per_stage("t_b", t_b, stages), w)]
    comm = _per_stage("t_comm", t_comm, max(stages - 1, 0))
    durations = (f, b, w)
    end = [-1.0] * (3 * stages * compiled.num_microbatches)
    position = [0] * compiled.num_ranks
    free = [0.0] * compiled.num_ranks
    last_grad = [0.0] * compiled.num_ranks
    grad_kind = 2 if compiled.splits_backward else 1
    waiting: dict[int, list[int]] = {}  # action id -> the ranks blocked on it
    ready = list(range(compiled.num_ranks))
    while ready:
        rank = ready.pop()
        rows, i, now = compiled.rows[rank], position[rank], free[rank]
        while i < len(rows):
            ident, kind, s, n1, c1, n2, c2 = rows[i]
            if n1 >= 0:
                e = end[n1]
                if e < 0:
                    waiting.setdefault(n1, []).append(rank)
                    break
                e += comm[c1] if c1 >= 0 else 0.0
                now = e if e > now else now
            if n2 >= 0:
                e = end[n2]
                if e < 0:
                    waiting.setdefault(n2, []).append(rank)
                    break
                e += comm[c2] if c2 >= 0 else 0.0
                now = e if e > now else now
            if kind == grad_kind:
                last_grad[rank] = now
            now += durations[kind][s]
            end[ident] = now
            i += 1
            if ident in waiting:
                ready += waiting.pop(ident)
        position[rank], free[rank] = i, now
    stuck = [r for r in range(compiled.num_ranks) if position[r] < len(compiled.rows[r])]
    if stuck:
        raise ScheduleError(
            f"{compiled.name} deadlocks on ranks {stuck}; run plait.schedule.validate on it"
        )
    return StepTime(max(free, default=0.0), tuple(free), tuple(last_grad))
