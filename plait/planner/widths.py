"""Config(): one pipeline of stages of different tp widths, where it is predicted faster than every uniform layout."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from plait.config import Config
from plait.errors import ConfigError
from plait.job.ranks import local_world_size
from plait.plan.cost import Cluster
from plait.plan.report import PlanReport
from plait.plan.width_search import MixedWidths, search_widths, stage_widths
from plait.planner.autoplan import PlanResult
from plait.planner.tp_shares import tp_shares
from plait.capture.trace import CapturedGraph

__all__ = ["WORLD_SIZES", "mixed_widths_choice"]

log = logging.getLogger("plait")

WORLD_SIZES = range(3, 17)  # worlds searched: 2 ranks have no uneven split; beyond 16 the tables grow


def _allowed(config: Config, world_size: int) -> bool:
    """Whether the config leaves the layout open to what the widths' pass prices (one pipeline,
    1F1B or GPipe, recomputation on every stage or none, weight gradients per micro-batch) and asks
    for nothing stages of different widths do not run with: `Config.tp_per_stage`'s own check, on a
    two-stage probe."""
    if not (config.plans_everything and config.tp is None and config.tp_per_stage is None
            and world_size in WORLD_SIZES and config.schedule in (None, "1f1b", "gpipe")
            and config.recompute in (None, False, True) and config.batch_weight_grads in (None, False)):
        return False
    try:
        replace(config, layers_per_proc=(1, 1), tp_per_stage=(2, 1))
    except ConfigError:
        return False
    return True


def mixed_widths_choice(captured: CapturedGraph, config: Config, world_size: int, result: PlanResult,
                        cluster: Cluster) -> tuple[dict[str, Any], PlanReport] | None:
    """(Config fields, report) of the best pipeline of uneven stage widths, when the config allows
    it and it is predicted faster than the best uniform layout; else None."""
    if not _allowed(config, world_size) or not result.best.feasible:
        return None
    widths = stage_widths(world_size, local_world_size(world_size))
    shares = {}
    for w in widths[1:]:
        try:
            shares[w] = tp_shares(captured, w)
        except Exception as e:  # noqa: BLE001 - a graph the layout cannot read: that width is not priced
            log.debug("plait: tp=%d not priced for stages of different widths (%s)", w, e)
    costs = result.profile.costs
    recompute = (False, True) if config.recompute is None else (config.recompute is True,)
    found = search_widths(costs, shares, world_size, result.global_batch, cluster, widths, recompute=recompute)
    if found is None or found.step_time_s >= result.best.step_time_s:
        return None
    return _fields(found), _report(found, result, costs.names, cluster)


def _fields(found: MixedWidths) -> dict[str, Any]:
    return {"layers_per_proc": list(found.layers_per_stage), "tp_per_stage": list(found.widths), "dp": 1,
            "num_microbatches": found.num_microbatches, "schedule": found.schedule, "num_virtual_stages": 1,
            "recompute": found.recompute, "zero": 0, "batch_weight_grads": False}


def _report(found: MixedWidths, result: PlanResult, names: tuple[str, ...], cluster: Cluster) -> PlanReport:
    stages, start = [], 0
    for s, (size, width, time_s) in enumerate(zip(found.layers_per_stage, found.widths, found.stage_s)):
        stages.append({"stage": s, "tp": width, "layers": list(names[start:start + size]), "first_layer": start,
                       "num_layers": size, "time_s": time_s, "mesh": {"dp": 1, "tp": width}})
        start += size
    chosen = {"pp": len(found.widths), "dp": 1, "tp": 1, "tp_per_stage": list(found.widths),
              "num_microbatches": found.num_microbatches, "schedule": found.schedule, "num_virtual_stages": 1,
              "recompute": found.recompute, "zero": 0, "batch_weight_grads": False,
              "layers_per_stage": list(found.layers_per_stage), "feasible": True,
              "predicted_step_time_s": found.step_time_s, "timing": "closed form", "stages": stages}
    line = (f"chosen: stages of different tp widths {list(found.widths)}, layers {list(found.layers_per_stage)}, "
            f"{found.num_microbatches} micro-batches, {found.schedule}{', recomputed' if found.recompute else ''}: "
            f"{found.step_time_s:.4f} s a step, "
            f"faster than the best uniform layout above ({result.best.step_time_s:.4f} s)")
    data = result.to_dict()
    return PlanReport(chosen, [result.best.to_dict(), *data["alternatives"]], result.table() + "\n" + line,
                      "planned", result.global_batch, result.profile.costs, cluster)
