"""Re-partitioning a running model whose stages are off the prediction (`Config(replan=True)`).

Rank 0 searches the same setting (pp, dp, micro-batches, schedule, recomputation) again with
each layer's costs scaled by its stage's measured / predicted time (`corrected_costs`), and
every rank gets its answer: a new `PlanReport`. When the layers move, `Model` re-lays itself
out through the checkpoint machinery (`plait.checkpoint.model_checkpoints`), so the parameters
and the optimizer state go on exactly as they were.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from plait.planner.plan_report import PlanReport
from plait.runtime.agree import agree
from plait.search.feedback import Feedback, corrected_costs
from plait.search.search import SearchSpace, format_table, search

__all__ = ["replanned_layers", "replan"]

log = logging.getLogger("plait")


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
