"""The closed loop's measurement: each stage's time in the first training steps, against the plan.

Steps 1 .. WARMUP_STEPS are not timed (the first one captures, describes its messages and
allocates); the next MEASURED_STEPS are. During them a `StageClock` stands in for the
interpreter's tracer (passing every span on to it) and sums the F, B and W compute of each
stage; the step is timed from its start to the end of the optimizer step. Then every rank
adds its sums into one all-reduce, so all ranks get the same numbers:

    stage s: F + B + W of one micro-batch = sum of its F/B/W times / its forwards (all replicas)
    step:    the mean over ranks of the mean step time

and `plait.search.feedback` compares them with the plan's prediction.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, ContextManager

from plait.planner.plan_report import PlanReport
from plait.runtime.comm.collectives import sum_floats
from plait.search.feedback import Feedback, StageCheck

__all__ = ["WARMUP_STEPS", "MEASURED_STEPS", "StageClock", "PlanCheck"]

WARMUP_STEPS = 1
MEASURED_STEPS = 3


class _Timed:
    """A compute span timed for the clock, inside the wrapped tracer's own span."""

    __slots__ = ("_clock", "_inner", "_stage", "_op", "_start")

    def __init__(self, clock: "StageClock", inner: ContextManager[None], stage: int, op: str) -> None:
        self._clock, self._inner, self._stage, self._op = clock, inner, stage, op
        self._start = 0.0

    def __enter__(self) -> None:
        self._inner.__enter__()
        self._start = time.perf_counter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._clock.record(self._stage, self._op, time.perf_counter() - self._start)
        self._inner.__exit__(exc_type, exc, tb)


class StageClock:
    """A tracer wrapper summing F/B/W compute per stage; everything else goes to `inner`."""

    enabled = True

    def __init__(self, inner: Any, num_chunks: int) -> None:
        self.inner = inner
        self.seconds = [0.0] * num_chunks
        self.forwards = [0] * num_chunks

    def span(self, stream: str, name: str, **args: Any) -> ContextManager[None]:
        inner: ContextManager[None] = self.inner.span(stream, name, **args)
        op = args.get("op")
        if stream == "compute" and op in ("F", "B", "W"):
            return _Timed(self, inner, int(args.get("stage", 0)), str(op))
        return inner

    def record(self, stage: int, op: str, seconds: float) -> None:
        self.seconds[stage] += seconds
        if op == "F":
            self.forwards[stage] += 1

    def __getattr__(self, name: str) -> Any:  # add, write, meta... of the wrapped tracer
        return getattr(self.inner, name)


class PlanCheck:
    """Times the first steps of a planned run and, once, compares them with the report."""

    def __init__(self, report: PlanReport, world_size: int, first_step: int = 0) -> None:
        self.report = report
        self.num_chunks = report.setting().num_chunks
        self.world_size = world_size
        self.first_step = first_step  # steps before it belong to an earlier layout
        self.clock: StageClock | None = None
        self._step_s: list[float] = []
        self._start = 0.0
        self.done = False

    def before_step(self, interpreter: Any, step: int) -> None:
        """Call at the start of training step `step` (1-based)."""
        if self.done or step - self.first_step <= WARMUP_STEPS:
            return
        if self.clock is None:
            self.clock = StageClock(interpreter.tracer, self.num_chunks)
            interpreter.tracer = self.clock
        self._start = time.perf_counter()

    def after_step(self, interpreter: Any, step: int) -> Feedback | None:
        """Call after the optimizer step of `step`; returns the comparison (on every rank) after
        the last measured step, else None."""
        if self.done or self.clock is None:
            return None
        self._step_s.append(time.perf_counter() - self._start)
        if step - self.first_step < WARMUP_STEPS + MEASURED_STEPS:
            return None
        self.done = True
        interpreter.tracer = self.clock.inner
        clock = self.clock
        local = [*clock.seconds, *map(float, clock.forwards), sum(self._step_s) / len(self._step_s)]
        total = sum_floats(local) if self.world_size > 1 else local
        n = self.num_chunks
        measured = [total[s] / total[n + s] if total[n + s] else 0.0 for s in range(n)]
        step_s = total[2 * n] / self.world_size
        predicted = self.report.predicted_stage_s
        if len(predicted) != n:  # a report of another layout (cannot happen once planned)
            return None
        checks = tuple(StageCheck(s, predicted[s], measured[s]) for s in range(n))
        return Feedback(checks, self.report.predicted_step_s or 0.0, step_s)
