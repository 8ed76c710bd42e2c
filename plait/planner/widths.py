"""Config(): one pipeline of stages of different tp or dp widths, where predicted faster than any uniform layout.

The search is `plait.search.width_search.search_stage_widths` within its `WIDTH_LIMITS`, the one
`plait plan` prints (`plait.cli.plan_command`); here is what a `Config` allows of it, and each tp
width's shares read off the captured graph (`width_shares`, which `plait plan --model` reads too).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Sequence

from plait.capture.trace import CapturedGraph
from plait.config import Config
from plait.cost.memory import split_held_in_precision
from plait.cost.prediction import Cluster
from plait.cost.tp_costs import TpShares
from plait.errors import ConfigError
from plait.job.ranks import local_world_size
from plait.planner.autoplan import PlanResult
from plait.planner.plan_report import PlanReport
from plait.planner.tp_shares import tp_shares
from plait.schedule.registry import schedule_spec, width_schedules
from plait.search.dp_widths import MixedDp
from plait.search.search import SearchSpace
from plait.search.width_search import (WIDTH_LIMITS, MixedWidths, WidthChoices, search_stage_widths,
                                       stage_widths)

__all__ = ["mixed_widths_choice", "width_shares"]

log = logging.getLogger("plait")


def _allowed(config: Config, probe: dict[str, Any]) -> bool:
    """Whether the config leaves the layout open to what the widths' passes price (one pipeline,
    1F1B or GPipe, recomputation on every stage or none, weight gradients per micro-batch) and asks
    for nothing stages of different widths do not run with: the `probe` field's own check
    (`Config.stage_tp`, `Config.stage_dp`), on a two-stage cut."""
    if not (config.plans_everything and config.stage_tp is None
            and (config.schedule is None or schedule_spec(config.schedule).mixed_widths)
            and config.recompute in (None, False, True) and config.batch_weight_grads in (None, False)):
        return False
    try:
        replace(config, layers_per_stage=(1, 1), **probe)
    except ConfigError:
        return False
    return True


def mixed_widths_choice(captured: CapturedGraph, config: Config, world_size: int, result: PlanResult,
                        cluster: Cluster, loss: Any = None, target: Any = None,
                        ) -> tuple[dict[str, Any], PlanReport] | None:
    """(the candidate's layout keys, report) of the best pipeline of uneven stage widths (tp or dp,
    `search_stage_widths`), when the config allows it and it is predicted faster than the best
    uniform layout; else None. `loss` and `target`: how a split last stage's loss runs (`tp_shares`)."""
    if not result.best.feasible:
        return None
    costs = result.profile.costs
    recompute = (False, True) if config.recompute is None else (config.recompute is True,)
    schedules = (config.schedule,) if config.schedule else width_schedules()
    # the limits are the search's own; asked here first so that no width's shares are read beyond them
    tp = config.tp is None and WIDTH_LIMITS.allow(world_size, costs.num_layers) \
        and _allowed(config, {"stage_tp": (2, 1)})
    unsharded = not config.zero  # dp widths are priced without ZeRO: a config asking for it is not searched
    dp = config.tp in (None, 1) and unsharded and WIDTH_LIMITS.allow(world_size, costs.num_layers, dp=True) \
        and _allowed(config, {"stage_dp": (2, 1)})
    degrees = stage_widths(world_size, local_world_size(world_size)) if tp else ()
    choices = WidthChoices(degrees, dp, SearchSpace(schedules=schedules, recompute=recompute))
    found = search_stage_widths(costs, width_shares(captured, degrees, loss, target, config.precision), world_size,
                                result.global_batch, cluster, choices, beat=result.best.step_time_s)
    best = found.fastest()
    if best is None or best.step_time_s >= result.best.step_time_s:
        return None
    names = costs.names
    return (_fields(best), _report(best, result, names, cluster)) if isinstance(best, MixedWidths) else \
        (_dp_fields(best), _dp_report(best, result, names, cluster))


def width_shares(captured: CapturedGraph, degrees: Sequence[int], loss: Any = None,
                 target: Any = None, precision: str = "fp32") -> dict[int, TpShares]:
    """Each tp width's shares of the layers' costs, read off the captured graph (`tp_shares`; in a
    low `precision`, its split bytes as held: `split_held_in_precision`); a width the graph cannot
    be split at is left out (not priced)."""
    shares = {}
    for w in degrees:
        if w > 1:
            try:
                shares[w] = split_held_in_precision(tp_shares(captured, w, None, loss, target), precision)
            except Exception as e:  # noqa: BLE001 - a graph the layout cannot read: that width is not priced
                log.debug("plait: tp=%d not priced for stages of different widths (%s)", w, e)
    return shares


def _fields(found: MixedWidths) -> dict[str, Any]:
    return {"layers_per_stage": list(found.layers_per_stage), "stage_tp": list(found.widths), "dp": found.dp,
            "num_microbatches": found.num_microbatches, "schedule": found.schedule, "num_virtual_stages": 1,
            "recompute": found.recompute, "zero": 0, "batch_weight_grads": False, "crossing": found.crossing}


def _dp_fields(found: MixedDp) -> dict[str, Any]:
    return {"layers_per_stage": list(found.layers_per_stage), "stage_dp": list(found.dp), "dp": 1,
            "num_microbatches": found.num_microbatches, "schedule": found.schedule, "num_virtual_stages": 1,
            "recompute": found.recompute, "zero": 0, "batch_weight_grads": False}


def _report(found: MixedWidths, result: PlanResult, names: tuple[str, ...], cluster: Cluster) -> PlanReport:
    copies = f" x dp={found.dp} copies of the pipeline" if found.dp > 1 else ""
    line = (f"chosen: stages of different tp widths {list(found.widths)}{copies}, layers {list(found.layers_per_stage)}, "
            f"{found.num_microbatches} micro-batches, {found.schedule}{', recomputed' if found.recompute else ''}, "
            f"crossing as {found.crossing}: {found.step_time_s:.4f} s a step, "
            f"faster than the best uniform layout above ({result.best.step_time_s:.4f} s)")
    return _widths_report(found, {"stage_tp": list(found.widths), "crossing": found.crossing},
                          [{"dp": found.dp, "tp": w} for w in found.widths],
                          line, result, names, cluster, found.dp)


def _dp_report(found: MixedDp, result: PlanResult, names: tuple[str, ...], cluster: Cluster) -> PlanReport:
    line = (f"chosen: stages of different dp widths {list(found.dp)} (replicas each running an equal block of "
            f"every micro-batch's rows), layers {list(found.layers_per_stage)}, {found.num_microbatches} "
            f"micro-batches, {found.schedule}{', recomputed' if found.recompute else ''}: "
            f"{found.step_time_s:.4f} s a step, "
            f"faster than the best uniform layout above ({result.best.step_time_s:.4f} s)")
    return _widths_report(found, {"stage_dp": list(found.dp)}, [{"dp": w, "tp": 1} for w in found.dp],
                          line, result, names, cluster)


def _widths_report(found: MixedWidths | MixedDp, widths: dict[str, Any], meshes: list[dict[str, int]], line: str,
                   result: PlanResult, names: tuple[str, ...], cluster: Cluster, copies: int = 1) -> PlanReport:
    """The report of a pipeline of uneven stage widths (`copies` of it): its stages, each on its own
    `meshes[s]`."""
    stages, start = [], 0
    for s, (size, mesh, time_s) in enumerate(zip(found.layers_per_stage, meshes, found.stage_s)):
        stages.append({"stage": s, "tp": mesh["tp"], "layers": list(names[start:start + size]), "first_layer": start,
                       "num_layers": size, "time_s": time_s, "mesh": mesh})
        start += size
    chosen = {"pp": len(meshes), "dp": copies, "tp": 1, **widths,
              "num_microbatches": found.num_microbatches, "schedule": found.schedule, "num_virtual_stages": 1,
              "recompute": found.recompute, "zero": 0, "batch_weight_grads": False,
              "layers_per_stage": list(found.layers_per_stage), "feasible": True,
              "predicted_step_time_s": found.step_time_s, "timing": "closed form", "stages": stages}
    data = result.to_dict()
    return PlanReport(chosen, [result.best.to_dict(), *data["alternatives"]], result.table() + "\n" + line,
                      "planned", result.global_batch, result.profile.costs, cluster)
