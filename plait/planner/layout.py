"""The layout of a run: a `Config` with sizes left open, planned on rank 0, the same on every rank.

Which layout a run gets, first match wins (`choose_layout`):

    1. one process, or the cut given           the config as it is (defaults for what is open);
       (layers_per_stage or split_points)      split_points become layers_per_stage here (stages
                                               of different widths, Config.stage_tp, give it)
    2. Config(plan=path)                       the plan file, checked against world and layers
    3. resuming a checkpoint, layers open      the checkpoint's layout (so a resume is exact)
    4. no size given (Config())                profile, search pp x dp, micro-batches, schedule,
                                               recomputation, ZeRO (`plait.planner.autoplan.plan_model`)
    5. a size given (num_stages, dp, m)        profile, the optimal partition of that layout (and
                                               its ZeRO level, unless Config.zero is given)

Config.zero, when given, is the only level searched, and overrides a plan file's or a resumed
checkpoint's (sharding does not change what a checkpoint holds: it loads into any level).

Rank 0 decides and every other rank reads its answer (`plait.runtime.agree`): profiles differ
between processes, so ranks planning on their own could disagree. The other ranks run the same
profile meanwhile, so rank 0 measures with its host as loaded as in training, and each round
of it takes the slowest rank's whole-model times (`plait.planner.profile`: a step waits for its slowest
rank); then they drop it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from plait import data as batching
from plait.capture.trace import CapturedGraph
from plait.config import Config
from plait.config.aliases import new_names
from plait.schedule.registry import SCHEDULE_NAMES
from plait.cost.network import Network
from plait.errors import ConfigError, PartitionError
from plait.job.ranks import local_world_size
from plait.materialize import on_meta
from plait.plan import Plan
from plait.planner.autoplan import PlanOptions, plan_model, profile_sample
from plait.planner.calibrate import calibrate
from plait.planner.choice import SearchInputs, candidate_fields, choose, search_inputs
from plait.planner.plan_report import PlanReport
from plait.planner.resolve import complete_plan, resolve_plan
from plait.runtime.agree import agree
from plait.runtime.comm.collectives import max_floats
from plait.runtime.failure import failure_error
from plait.runtime.memory.memory_stats import state_factor
from plait.search.split_points import cut_at

__all__ = ["Workload", "Layout", "choose_layout", "layout_of", "candidate_fields", "load_plan_file"]

log = logging.getLogger("plait")

@dataclass(frozen=True)
class Workload:
    """What a run plans for: the model, its capture (train mode), a sample batch as `fit` takes it
    (its rows are the global batch), the targets, the loss, the user's optimizer argument and the
    ranks' device."""

    net: nn.Module
    captured: CapturedGraph
    x: Any
    y: Any = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: Any = None
    device: torch.device = torch.device("cpu")  # the ranks' device: the tp search prices its preset

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(self.captured.layers.layer_names)


@dataclass(frozen=True)
class Layout:
    """The config with every layout field set, the complete plan it resolves to, and the
    planner's report (None: not planned)."""

    config: Config
    plan: Plan
    report: PlanReport | None

    @property
    def num_stages(self) -> int:
        """Ranks per pipeline."""
        return self.plan.pp


def layout_of(config: Config, work: Workload, world_size: int, report: PlanReport | None = None) -> Layout:
    """`config` (its sizes set) with the complete plan it gives on `world_size` ranks."""
    plan = resolve_plan(config, world_size, work.captured, work.net)
    return Layout(config, complete_plan(plan, work.captured, config.memory_limit_bytes, work.device,
                                        2.0 + state_factor(work.optimizer)), report)


def choose_layout(work: Workload, config: Config, world_size: int, rank: int,
                  resumed_plan: dict[str, Any] | None = None) -> Layout:
    """The layout of this run (see the module's list); every rank returns the same one."""
    if config.stage_tp is not None:  # stages of different widths: the user's cut, not planned
        layers = config.layers_per_stage or cut_at(config.split_points or (), work.layer_names,
                                                  work.captured.layers.uncuttable)
        return layout_of(replace(config.with_defaults(), split_points=None, layers_per_stage=layers), work, world_size)
    if config.tp is None:  # the planner's choice, where it plans the whole layout by timing
        tp = _fixed_tp(work, config, world_size, resumed_plan)
        if tp is not None:
            return choose_layout(work, replace(config, tp=tp, tp_plan=config.tp_plan if tp > 1 else None),
                                 world_size, rank, resumed_plan)
    if config.tp is not None and config.tp > 1:  # planned on the pp x dp ranks of one tensor-parallel part, then run on all
        lanes = choose_layout(work, replace(config, tp=1, tp_plan=None), config.lanes(world_size), rank, resumed_plan)
        return layout_of(replace(lanes.config, tp=config.tp, tp_plan=config.tp_plan), work, world_size, lanes.report)
    if world_size == 1:
        return layout_of(replace(config.with_defaults(), layers_per_stage=None, split_points=None,
                                 num_stages=None), work, 1)
    if config.split_points is not None:  # the layout's config counts layers, as a planned one does
        layers = cut_at(config.split_points, work.layer_names, work.captured.layers.uncuttable)
        config = replace(config, split_points=None, layers_per_stage=layers)
    if config.layers_per_stage is not None:
        return layout_of(config.with_defaults(), work, world_size)
    if config.plan is None and on_meta(work.net):  # nothing to time: cut by parameter counts
        if config.plans_everything:
            raise ConfigError(
                "the model is on the meta device, so plait cannot time its layers to plan the layout; "
                "give the layout: num_stages (and dp), layers_per_stage or split_points"
            )
        return layout_of(config.with_defaults(), work, world_size)

    network = None
    if config.plan is None and (resumed_plan is None or _resumed_fields(
            resumed_plan, config, world_size, work.layer_names) is None):
        try:
            network = calibrate()  # rank 0 will search: it prices messages with this backend's link
        except Exception as e:  # noqa: BLE001 - a peer failed (its model raised capturing it): name it
            raise failure_error("measuring the link to plan the layout", rank, e, config.timeout_s) from e
        if rank != 0:
            _profile_alongside(work, config, world_size)

    def decide() -> dict[str, Any]:
        return _decide(work, config, world_size, resumed_plan, network)

    # Rank 0's profile may take longer than a step's waits: give it ten times as long.
    answer = agree(rank, decide, "layout plan", max(10 * config.timeout_s, 120.0))
    fields = dict(answer["fields"])
    for name in ("layers_per_stage", "recompute", "recompute_by_layer"):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])
    if fields.get("tp", 1) == 1:
        fields["tp_plan"] = None
    resolved = replace(config, **fields, plan=None).with_defaults()  # the file is applied
    report = None if answer["report"] is None else PlanReport.from_dict(answer["report"], answer["table"])
    if rank == 0:
        log.info("plait: layout %s (%s)", fields, report.source if report else answer["source"])
    return layout_of(resolved, work, world_size, report)


def _fixed_tp(work: Workload, config: Config, world_size: int, resumed_plan: dict[str, Any] | None) -> int | None:
    """Config(tp=None): the tp when nothing is left to choose (1 where the layout is not planned by
    timing: one rank, sizes given, a plan file, a meta model; else a resumed checkpoint's, on the
    world it was saved on), or None: the search chooses it."""
    if world_size == 1 or not config.plans_everything or config.plan is not None or on_meta(work.net):
        return 1
    if resumed_plan is not None and resumed_plan.get("world_size") == world_size:
        if resumed_plan.get("stage_tp"):  # stages of different widths: the resumed fields say which
            return None
        return int(resumed_plan.get("tp", 1) or 1)
    return None


def _decide(work: Workload, config: Config, world_size: int, resumed_plan: dict[str, Any] | None,
            network: Network | None = None) -> dict[str, Any]:
    """Rank 0's choice as JSON: {"fields", "report", "table", "source"}."""
    if config.plan is not None:
        fields, report = load_plan_file(config.plan, work.layer_names, world_size)
        return {"fields": _users_zero(fields, config), "report": report.to_dict() if report else None,
                "table": report.table if report else "", "source": f"plan file {config.plan}"}
    if resumed_plan is not None:
        kept = _resumed_fields(resumed_plan, config, world_size, work.layer_names)
        if kept is not None:
            return {"fields": _users_zero(kept, config), "report": None, "table": "",
                    "source": "the resumed checkpoint"}
    inputs = _search_inputs(config, world_size, work, network)
    options = replace(_profile_options(work), space=inputs.space, tp=inputs.tp,
                      tp_plan=config.tp_plan if config.tp is None else None)
    try:
        result = plan_model(work.net, work.x, world_size, batching.num_rows(work.x), inputs.cluster, options)
    except (ConfigError, PartitionError):
        if config.plans_everything:
            raise
        # The layout cannot be searched (more stages than layers...): the pipeline's own
        # checks say what is wrong, on every rank.
        return {"fields": {}, "report": None, "table": "", "source": "unplanned"}
    chosen = choose(result, config, world_size, inputs.source, work.captured, work.loss, work.y)
    return {"fields": chosen.fields, "report": chosen.report.to_dict(), "table": chosen.report.table,
            "source": inputs.source}


def _users_zero(fields: dict[str, Any], config: Config) -> dict[str, Any]:
    """A replayed layout's fields with Config.zero and Config.batch_weight_grads in place of the
    saved ones, where given."""
    fields = fields if config.zero is None else {**fields, "zero": config.zero}
    return fields if config.batch_weight_grads is None else {**fields, "batch_weight_grads": config.batch_weight_grads}


def _search_inputs(config: Config, world_size: int, work: Workload, network: Network | None) -> SearchInputs:
    """What the search may choose and what it prices with (`plait.planner.choice`: the command's too)."""
    return search_inputs(config, world_size, batching.num_rows(work.x), local_world_size(world_size),
                         state_factor(work.optimizer), network, dist.get_backend() if dist.is_initialized() else "")


def _profile_options(work: Workload) -> PlanOptions:
    """A planning profile: every rank of the job (planning runs on several) profiles at once."""
    return PlanOptions(optimizer=_optimizer_factory(work.optimizer), loss=work.loss,
                       target=work.y if work.loss is not None else None, slowest=max_floats,
                       captured=work.captured)


def _profile_alongside(work: Workload, config: Config, world_size: int) -> None:
    """Run rank 0's profile on this rank too, at the same time, and drop the result.

    Ranks sharing a host share its caches and memory bandwidth: on 2 CPU ranks, a profile taken
    while the other rank idled priced the steps of benchmarks/planner.py (c) at 0.74-0.86 of their
    measured time, one taken with both ranks profiling at 0.86-0.98. With every rank profiling,
    rank 0 measures under the load it will train under, and the profile's rounds take the slowest
    rank's whole-model times (a collective per round: this rank must profile whenever rank 0
    does). Rank 0 fails before profiling exactly when the search's inputs are wrong: this rank
    checks them first and then leaves the profile out. A failure in the profile is rank 0's to
    report: it runs the same profile.
    """
    try:
        _search_inputs(config, world_size, work, None)
    except (ConfigError, PartitionError):
        return
    try:
        profile_sample(work.net, work.x, world_size, _profile_options(work))
    except Exception as error:  # noqa: BLE001 - rank 0 raises the same error in its own profile
        log.debug("plait: rank-side profile failed (rank 0 reports it): %s", error)


def _optimizer_factory(optimizer: Any) -> Any:
    if isinstance(optimizer, torch.optim.Optimizer):
        kind, defaults = type(optimizer), dict(optimizer.defaults)
        return lambda params: kind(params, **defaults)
    return optimizer if callable(optimizer) else torch.optim.Adam


def _resumed_fields(plan: dict[str, Any], config: Config, world_size: int,
                    names: tuple[str, ...]) -> dict[str, Any] | None:
    """A resumed checkpoint's layout, when it was saved on this world by this model and agrees
    with what the config fixes; else None (planned afresh)."""
    try:
        if int(plan["world_size"]) != world_size or tuple(plan["layer_names"]) != names:
            return None
        layers = [int(c) for c in plan["layers_per_stage"]]
        v, dp = int(plan.get("num_virtual_stages", 1)), int(plan.get("dp", 1))
        full: dict[str, Any] = {"layers_per_stage": layers, "num_stages": len(layers) // v, "dp": dp,
                "num_microbatches": int(plan["num_microbatches"]), "schedule": str(plan["schedule"]),
                "num_virtual_stages": v, "recompute": [int(s) for s in plan.get("recompute", [])],
                "recompute_by_layer": [int(s) for s in plan.get("recompute_by_layer", [])],
                "zero": int(plan.get("zero", 0) or 0),
                "batch_weight_grads": bool(plan.get("batch_weight_grads", False))}
        widths = _width_fields(plan.get("stage_tp"), plan.get("stage_dp"), plan.get("crossing", "tiles"))
    except (KeyError, TypeError, ValueError):
        return None
    if widths:  # a pipeline of stages of different widths, as saved
        full.update(widths, num_stages=None)
    if config.zero and dp == 1:  # the config's ZeRO needs replicas this layout lacks: plan afresh
        return None
    if config.plans_everything:
        return full
    c = config.with_defaults()
    if c.num_virtual_stages == v and c.stages_for(world_size) * v == len(layers):
        return {"layers_per_stage": layers, "zero": full["zero"]}  # the same pp, so the same dp
    return None


def load_plan_file(path: str, names: tuple[str, ...], world_size: int) -> tuple[dict[str, Any], PlanReport | None]:
    """Config fields from a plan file (planner JSON or `Plan.to_json()`), checked against this
    run: ConfigError naming the file and what does not match."""
    where = f"Config(plan={path!r})"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the plan file ({e}); give the path of a saved plan") from None
    except ValueError as e:
        raise ConfigError(f"{where}: the file is not JSON ({e}); expected model.plan_report.save() "
                          "or `plait plan -o` output") from None
    if isinstance(data, dict):  # a file saved before the planner's JSON took the Plan's names (tp_per_stage, ...)
        data = new_names(data, where)
    if not isinstance(data, dict) or "layers_per_stage" not in data:
        raise ConfigError(f"{where}: not a plait plan (no layers_per_stage); expected "
                          "model.plan_report.save(), `plait plan -o` or model.plan.to_json() output")
    fields: dict[str, Any]
    try:
        if "layer_names" in data:  # Plan.to_json()
            fields = {"layers_per_stage": [int(c) for c in data["layers_per_stage"]],
                      "dp": int(data.get("dp", 1)), "num_microbatches": int(data["num_microbatches"]),
                      "schedule": str(data["schedule"]),
                      "num_virtual_stages": int(data.get("num_virtual_stages", 1)),
                      "recompute": [int(s) for s in data.get("recompute", [])],
                      "recompute_by_layer": [int(s) for s in data.get("recompute_by_layer", [])],
                      "zero": int(data.get("zero", 0) or 0),
                      "batch_weight_grads": bool(data.get("batch_weight_grads", False))}
            saved_names = tuple(str(n) for n in data["layer_names"])
            saved_world = int(data["world_size"])
            widths = _width_fields(data.get("stage_tp"), data.get("stage_dp"), data.get("crossing", "tiles"))
        else:  # the planner's JSON
            if data.get("feasible") is False:
                raise ConfigError(f"{where}: the plan in the file is infeasible: {data.get('reason')}")
            fields = candidate_fields(data)
            fields.pop("tp")  # a plan file gives the pp x dp layout; Config.tp gives tp
            saved_names = tuple(str(n) for s in data.get("stages", []) for n in s.get("layers", []))
            saved_world = fields["num_stages"] * fields["dp"]
            widths = _width_fields(data.get("stage_tp"), data.get("stage_dp"), data.get("crossing", "tiles"))
        fields.update(widths)  # a pipeline of stages of different widths: on their ranks
        for field, copies in (("stage_tp", fields["dp"]), ("stage_dp", 1)):
            if field in widths:
                saved_world = sum(widths[field]) * copies
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: malformed plan file ({type(e).__name__}: {e})") from None
    fields.pop("num_stages", None)
    if fields["schedule"] not in SCHEDULE_NAMES:
        raise ConfigError(f"{where}: unknown schedule {fields['schedule']!r} in the file")
    if saved_world != world_size:
        raise ConfigError(f"{where}: the plan is for {saved_world} ranks but the world size is "
                          f"{world_size}; launch {saved_world} ranks or plan again for {world_size}")
    count = sum(fields["layers_per_stage"])
    if count != len(names) or (saved_names and saved_names != names):
        raise ConfigError(
            f"{where}: the plan cuts {count} layers ({', '.join(saved_names[:6]) or 'names not saved'}"
            f"{', ...' if len(saved_names) > 6 else ''}) but this model has {len(names)} "
            f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}); it was made for another "
            "model: plan again (Config without plan=)"
        )
    report = None
    if "layer_names" not in data and data.get("stages"):
        report = PlanReport(
            {k: v for k, v in data.items() if k not in ("alternatives", "costs", "cluster", "feedback")},
            [], _stage_table(data), f"plan file {path}",
            int(data.get("global_batch", 0) or 0))
    return fields, report


def _width_fields(tp: Any, dp: Any, crossing: Any) -> dict[str, Any]:
    """Config fields of a saved pipeline of stages of different widths: its tp per stage (and
    crossing), or dp per stage; {} for a uniform one (neither saved)."""
    out: dict[str, Any] = {}
    if tp:
        out.update(stage_tp=[int(w) for w in tp], crossing=str(crossing))
    if dp:
        out["stage_dp"] = [int(w) for w in dp]
    return out


def _stage_table(chosen: dict[str, Any]) -> str:
    """The replayed candidate's stages, one a line (the profile behind it is not in the file)."""
    widths = "".join(f" {k}={chosen[k]}" for k in ("stage_tp", "stage_dp") if chosen.get(k))
    lines = [f"pp={chosen['pp']} dp={chosen['dp']}{widths} {chosen['num_microbatches']} micro-batches "
             f"{chosen['schedule']} recompute={chosen.get('recompute', False)} "
             f"zero={chosen.get('zero', 0) or 0}, predicted step "
             f"{chosen.get('predicted_step_time_s') or 0:.4f} s"]
    for s in chosen.get("stages", []):
        memory = f"  memory {float(s['memory_bytes']) / 2**30:.2f} GiB" if "memory_bytes" in s else ""
        lines.append(f"  stage {s['stage']:>2}: {s['num_layers']} layers from {s['first_layer']}  "
                     f"F+B+W {1e3 * float(s['time_s']):.3f} ms{memory}")
    return "\n".join(lines)
