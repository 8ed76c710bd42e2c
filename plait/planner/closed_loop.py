"""`ClosedLoop`: a planned run's first steps measured against the plan, and one replan when asked and due.

    steps 1 .. WARMUP + MEASURED    `PlanCheck` times each stage (plait.planner.check)
    after the last measured step    the report gains the check (`Feedback`), logged on rank 0
    Config(replan=True), far off    rank 0 searches again with corrected costs; a better layout
                                    comes back as a new `PlanReport`, which the model moves to
                                    and checks once more (one replan per run)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from plait.planner.check import PlanCheck
from plait.planner.plan_report import PlanReport
from plait.planner.replan import replan
from plait.search.feedback import should_replan

__all__ = ["ClosedLoop"]

log = logging.getLogger("plait")


class ClosedLoop:
    """The plan check of one planned run and its one replan; reports are new objects, never edited."""

    def __init__(self, report: PlanReport, rank: int, world_size: int, timeout_s: float, replan: bool) -> None:
        self.report = report  # the current layout's report, with its check once measured
        self.rank, self.world_size, self.timeout_s, self.replan = rank, world_size, timeout_s, replan
        self.check = PlanCheck(report, world_size)

    @property
    def done(self) -> bool:
        return self.check.done

    def before_step(self, interpreter: Any, step: int) -> None:
        """Call at the start of training step `step` (1-based)."""
        self.check.before_step(interpreter, step)

    def after_step(self, interpreter: Any, step: int) -> PlanReport | None:
        """Call after the optimizer step of `step`; a replanned report to move the model to, or None.

        `self.report` gains the check once the measured steps are over.
        """
        feedback = self.check.after_step(interpreter, step)
        if feedback is None:
            return None
        if self.rank == 0:
            log.info("%s", feedback.summary())
        self.report = dataclasses.replace(self.report, feedback=feedback)
        first = self.check.first_step == 0  # a replanned layout is only checked, not replanned again
        if not (self.replan and first and self.report.costs is not None and should_replan(feedback)):
            return None
        new = replan(self.report, feedback, step, self.rank, self.world_size, self.timeout_s)
        if new is not None:
            self.report = new
            self.check = PlanCheck(new, self.world_size, first_step=step)
        return new
