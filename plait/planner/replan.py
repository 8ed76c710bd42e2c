"""Re-partitioning a running model whose stages are off the prediction (`Config(replan=True)`).

Rank 0 searches the same setting (pp, dp, micro-batches, schedule, recomputation) again with
each layer's costs scaled by its stage's measured / predicted time (`corrected_costs`), and
every rank gets its answer. When the layers move, the model goes on in the new layout through
the checkpoint machinery, which loads any layout by name:

    save a checkpoint (each rank its own parameters and optimizer state)
    -> build the pipeline for the new layers (a fresh optimizer over the new local parameters)
    -> load it: every parameter, and each rank's optimizer state for its new parameters

so the parameters and the optimizer state go on exactly as they were. The checkpoint is
written under Config.checkpoint_dir (in `.replan/`, not a resumable step) or in a temporary
directory, and deleted after.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from plait.plan.feedback import Feedback, corrected_costs
from plait.plan.search import SearchSpace, format_table, search
from plait.plan.report import PlanReport
from plait.runtime.agree import agree
from plait.runtime.collectives import sum_floats

if TYPE_CHECKING:
    from plait.model import Model

__all__ = ["replanned_layers", "replan"]

log = logging.getLogger("plait")


def replanned_layers(report: PlanReport, measured_stage_s: Sequence[float], world_size: int) -> dict[str, Any]:
    """The best candidate of the report's setting under corrected costs: {"chosen":
    `Candidate.to_dict()`, "table": its table}."""
    assert report.costs is not None and report.cluster is not None
    costs = corrected_costs(report.costs, report.prediction(), measured_stage_s)
    st = report.setting()
    space = SearchSpace(pp=(st.pp,), num_microbatches=(st.num_microbatches,), schedules=(st.schedule,),
                        num_virtual_stages=max(st.num_virtual_stages, 2), recompute=(st.recompute,), keep=1)
    found = search(costs, world_size, report.global_batch, report.cluster, space)
    return {"chosen": found[0].to_dict(), "table": format_table(found)}


def replan(model: "Model", feedback: Feedback, x: Any) -> bool:
    """Re-partition `model` (on every rank) if rank 0 finds better layers; True if it did."""
    report = model.plan_report
    assert report is not None
    measured = [s.measured_s for s in feedback.stages]
    answer = agree(model.rank, lambda: replanned_layers(report, measured, model.world_size),
                   "replanned layout", max(10 * model.config.timeout_s, 120.0))
    chosen = answer["chosen"]
    old = list(report.chosen["layers_per_stage"])
    new = [int(c) for c in chosen["layers_per_stage"]]
    if new == old or not chosen.get("feasible", False):
        if model.rank == 0:
            log.info("plait: replan keeps the layers %s", old)
        return False
    if model.rank == 0:
        log.info("plait: replan moves the layers from %s to %s", old, new)
    root = model.config.checkpoint_dir
    if root is not None:
        scratch = str(Path(root) / ".replan")
    else:  # rank 0 names it; one node (or a path every rank sees)
        scratch = agree(model.rank, lambda: tempfile.mkdtemp(prefix="plait-replan-"), "replan directory", 60.0)
    saved_step = model._saved_step  # this scratch checkpoint is not one of the run's
    try:
        path = model._save(scratch, None)
        found = model._checkpointer.choose(path)
        assert found is not None
        report.history.append(f"{old} (step {model.step}: {feedback.summary()})")
        report.chosen, report.table = chosen, answer["table"] + "\n(replanned with costs corrected by the measured stage times)"
        report.feedback = None
        model._rebuild(dataclasses.replace(model.config, layers_per_proc=tuple(new)), x)
        model._restore(found)
        model._saved_step = saved_step
        if model.world_size > 1:
            sum_floats([0.0])  # every rank has read the checkpoint before it goes
    finally:
        if model.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    return True
