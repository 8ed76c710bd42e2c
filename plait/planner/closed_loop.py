"""`ClosedLoop`: a planned run's first steps measured against the plan, and one replan when asked and due.

    steps 1 .. WARMUP + MEASURED    `PlanCheck` times each stage (plait.planner.check)
    after the last measured step    the report gains the check (`Feedback`), logged on rank 0
    Config(replan=True), far off    rank 0 searches again with corrected costs; a better layout
                                    comes back as a new `PlanReport`, which the model moves to
                                    and checks once more (one replan per run)

The replan: rank 0 searches the same setting (pp, dp, micro-batches, schedule, recomputation) again with
each layer's costs scaled by its stage's measured / predicted time (`corrected_costs`), and
every rank gets its answer: a new `PlanReport`. When the layers move, `Model` re-lays itself
out through the checkpoint machinery (`plait.checkpoint.model_checkpoints`), so the parameters
and the optimizer state go on exactly as they were.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from plait.planner.check import PlanCheck
from plait.planner.plan_report import PlanReport
from plait.runtime.agree import agree
from plait.search.feedback import Feedback, corrected_costs, should_replan
from plait.search.search import SearchSpace, format_table, search

__all__ = ["ClosedLoop", "replanned_layers", "replan"]

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


def replanned_layers(report: PlanReport, measured_stage_s: Sequence[float], world_size: int) -> dict[str, Any]:
    """The best candidate of the report's setting under corrected costs: {"chosen":
    `Candidate.to_dict()`, "table": its table}."""
    assert report.costs is not None and report.cluster is not None
    costs = corrected_costs(report.costs, report.prediction(), measured_stage_s)
    st = report.setting()
    space = SearchSpace(pp=(st.pp,), num_microbatches=(st.num_microbatches,), schedules=(st.schedule,),
                        num_virtual_stages=max(st.num_virtual_stages, 2), recompute=(st.recompute,), zero=(st.zero,), keep=1)
    found = search(costs, world_size, report.global_batch, report.cluster, space)
    return {"chosen": found[0].to_dict(), "table": format_table(found)}


def replan(report: PlanReport, feedback: Feedback, step: int, rank: int, world_size: int,
           timeout_s: float) -> PlanReport | None:
    """The report of a better layout if rank 0 finds better layers (the same on every rank), else None.

    The new report keeps the old layout in its history; the caller moves the model to it.
    """
    measured = [s.measured_s for s in feedback.stages]
    answer = agree(rank, lambda: replanned_layers(report, measured, world_size),
                   "replanned layout", max(10 * timeout_s, 120.0))
    chosen = answer["chosen"]
    old = list(report.chosen["layers_per_stage"])
    new = [int(c) for c in chosen["layers_per_stage"]]
    if new == old or not chosen.get("feasible", False):
        if rank == 0:
            log.info("plait: replan keeps the layers %s", old)
        return None
    if rank == 0:
        log.info("plait: replan moves the layers from %s to %s", old, new)
    return dataclasses.replace(
        report, chosen=chosen, feedback=None,
        table=answer["table"] + "\n(replanned with costs corrected by the measured stage times)",
        history=(*report.history, f"{old} (step {step}: {feedback.summary()})"))
