"""The layout of a run: the user's `Config`, with sizes left open, made into one complete `Plan`, the same on every rank.

The layout takes three forms on its way: what the search may choose (`SearchSpace`, from the
Config: `plait.planner.choice.search_inputs`), the chosen candidate (the search's best, a plan
file's, a resumed checkpoint's: the planner's JSON, read by its layout keys), and the `Plan` it
resolves to beside the user's Config (`plait.planner.resolve.resolve_plan`, completed by
`complete_plan`); the candidate never becomes a Config. The model keeps the user's Config; the
runtime reads only the Plan (and `Config.execution()`).

Which layout a run gets, first match wins (`choose_layout`):

    1. one process, or the cut given           the config as it is (defaults for what is open);
       (layers_per_stage or split_points)      split_points become layers_per_stage here (stages
                                               of different widths, Config.stage_tp, give it);
                                               one stage with m, zero and recompute given too
    2. Config(plan=path)                       the plan file, checked against world and layers
    3. resuming a checkpoint, layers open      the checkpoint's layout (so a resume is exact)
    4. no size given (Config())                profile, search pp x dp, micro-batches, schedule,
                                               recomputation, ZeRO (`plait.planner.autoplan.plan_model`)
    5. a size given (num_stages, dp, m)        profile, the optimal partition of that layout (and
                                               its ZeRO level, unless Config.zero is given)

Config.zero, when given, is the only level searched, and overrides a plan file's or a resumed
checkpoint's (sharding does not change what a checkpoint holds: it loads into any level).

Rank 0 decides and makes the plan whole (tp layouts included), and every other rank reads that
plan (`plait.runtime.agree`): profiles differ between processes, so ranks planning on their own
could disagree. A layout given whole (a cut, one rank, a meta model with sizes) is resolved on
every rank alike, with no agreement. The other ranks run the same
profile meanwhile, so rank 0 measures with its host as loaded as in training, and each round
of it takes the slowest rank's whole-model times (`plait.planner.profile`: a step waits for its slowest
rank); then they drop it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from plait import data as batching
from plait.capture.compute_dtype import as_computed, dtype_of, held_in
from plait.capture.trace import CapturedGraph
from plait.config import Config
from plait.cost.network import Network
from plait.errors import ConfigError, PartitionError
from plait.job.ranks import local_world_size
from plait.materialize import on_meta
from plait.plan import Plan
from plait.planner.autoplan import PlanOptions, plan_model, profile_sample
from plait.planner.calibrate import calibrate
from plait.planner.choice import SearchInputs, choose, search_inputs
from plait.planner.plan_report import PlanReport
from plait.planner.replay import load_plan_file, resumed_fields
from plait.planner.resolve import complete_plan, resolve_plan
from plait.planner.tp_search import preset_of
from plait.runtime.agree import agree
from plait.runtime.comm.collectives import max_floats
from plait.runtime.failure import failure_error
from plait.runtime.memory.memory_stats import state_factor
from plait.search.partition import check_partition
from plait.search.split_points import cut_at

__all__ = ["Workload", "Layout", "choose_layout", "layout_of", "replanned", "load_plan_file"]

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
    """The complete plan every rank builds from, and the planner's report (None: not planned)."""

    plan: Plan
    report: PlanReport | None

    @property
    def num_stages(self) -> int:
        """Ranks per pipeline."""
        return self.plan.pp


def layout_of(config: Config, work: Workload, world_size: int, report: PlanReport | None = None,
              chosen: dict[str, Any] | None = None) -> Layout:
    """The complete plan of `config` with the `chosen` candidate's layout on `world_size` ranks
    (`plait.planner.resolve`), and the planner's report."""
    plan = resolve_plan(config, world_size, work.captured, work.net, chosen)
    return Layout(_completed(plan, work, config), report)


def replanned(layout: Layout, work: Workload, config: Config, report: PlanReport) -> Layout:
    """`layout` with the layers of a replanned `report` (the closed loop moves layers only: every
    other choice of the plan stays), completed for its new stages."""
    layers = tuple(int(n) for n in report.chosen["layers_per_stage"])
    check_partition(layers, layout.plan.layer_names, layout.plan.uncuttable)
    plan = replace(layout.plan, layers_per_stage=layers, tied_parameters=(), tp_layouts=(), stage_to_rank=())
    return Layout(_completed(plan, work, config), report)


def _completed(plan: Plan, work: Workload, config: Config) -> Plan:
    """`plan` with its tied parameters and tp layouts (`plait.planner.resolve.complete_plan`)."""
    return complete_plan(plan, work.captured, config.memory_limit_bytes, work.device, 2.0 + state_factor(work.optimizer))


def choose_layout(work: Workload, config: Config, world_size: int, rank: int,
                  resumed_plan: dict[str, Any] | None = None) -> Layout:
    """The layout of this run (see the module's list); every rank returns the same one.

    A given layout is resolved on every rank alike; a planned, replayed or resumed one is made
    whole on rank 0 and every rank reads its plan (`plait.runtime.agree`). A given tp > 1 is
    planned on the pp x dp ranks of one tensor-parallel part (`Config.lanes`), then run on all.
    """
    if config.stage_tp is not None:  # stages of different widths: the user's cut, not planned
        layers = config.layers_per_stage or cut_at(config.split_points or (), work.layer_names,
                                                  work.captured.layers.uncuttable)
        return layout_of(replace(config.with_defaults(), split_points=None, layers_per_stage=layers), work, world_size)
    if config.tp is None:  # the planner's choice, where it plans the whole layout by timing
        tp = _fixed_tp(work, config, world_size, resumed_plan)
        if tp is not None:
            config = replace(config, tp=tp, tp_plan=config.tp_plan if tp > 1 else None)
    split_tp = config.tp is not None and config.tp > 1
    lanes = config.lanes(world_size) if split_tp else world_size
    searched = replace(config, tp=1, tp_plan=None) if split_tp else config  # the layout of one tp part

    given = _given(work, searched, lanes)
    if given is not None:  # then run on every tp part
        return layout_of(replace(given, tp=config.tp, tp_plan=config.tp_plan), work, world_size)

    network = None
    if searched.plan is None and (resumed_plan is None or resumed_fields(
            resumed_plan, searched, lanes, work.layer_names) is None):
        try:
            network = calibrate()  # rank 0 will search: it prices messages with this backend's link
        except Exception as e:  # noqa: BLE001 - a peer failed (its model raised capturing it): name it
            raise failure_error("measuring the link to plan the layout", rank, e, config.timeout_s) from e
        if rank != 0:
            _profile_alongside(work, searched, lanes)

    def decide() -> dict[str, Any]:
        answer = _decide(work, searched, lanes, resumed_plan, network)
        fields = dict(answer.pop("fields"))
        if fields:  # the plan, made whole here once: every rank builds from it (with a given tp, on every part)
            plan = layout_of(config, work, world_size, chosen=fields).plan
            answer["plan"] = json.loads(plan.to_json())
            if rank == 0:
                log.info("plait: layout %s (%s)", fields, answer["source"])
        return answer

    # Rank 0's profile may take longer than a step's waits: give it ten times as long.
    answer = agree(rank, decide, "layout plan", max(10 * config.timeout_s, 120.0))
    report = None if answer["report"] is None else PlanReport.from_dict(answer["report"], answer["table"])
    if answer.get("plan") is None:  # not planned: the layout as given, whose own checks say what is wrong
        return layout_of(replace(config, plan=None), work, world_size, report)
    return Layout(Plan.from_json(json.dumps(answer["plan"])), report)


def _given(work: Workload, config: Config, world_size: int) -> Config | None:
    """The layout of `config` on `world_size` ranks where nothing is planned (one rank, a cut given,
    a meta model with sizes given), every size set; None: planned."""
    if world_size == 1:
        return replace(config.with_defaults(), layers_per_stage=None, split_points=None, num_stages=None)
    if config.split_points is not None:  # the layout's config counts layers, as a planned one does
        layers = cut_at(config.split_points, work.layer_names, work.captured.layers.uncuttable)
        config = replace(config, split_points=None, layers_per_stage=layers)
    if config.layers_per_stage is not None:
        return config.with_defaults()
    if _nothing_to_choose(config, world_size):
        return replace(config.with_defaults(), num_stages=1)
    if config.plan is None and on_meta(work.net):  # nothing to time: cut by parameter counts
        if config.plans_everything:
            raise ConfigError(
                "the model is on the meta device, so plait cannot time its layers to plan the layout; "
                "give the layout: num_stages (and dp), layers_per_stage or split_points"
            )
        return config.with_defaults()
    return None


def _nothing_to_choose(config: Config, world_size: int) -> bool:
    """One stage (num_stages=1, or dp taking every lane) with its micro-batches, ZeRO level and
    recomputation given: no cut to search and nothing left to price, so no profile is taken (a
    zero=3 rank then never holds the whole model's activations before its parameters are sharded)."""
    one_stage = config.num_stages == 1 or (config.dp is not None and config.dp * (config.tp or 1) == world_size)
    return (one_stage and config.plan is None and None not in (config.num_microbatches, config.zero, config.recompute)
            and config.stage_tp is None and config.stage_dp is None)


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
    """Rank 0's choice as JSON: {"fields" (the candidate's layout keys), "report", "table", "source"}."""
    if config.plan is not None:
        fields, report = load_plan_file(config.plan, work.layer_names, world_size)
        return {"fields": _users_zero(fields, config), "report": report.to_dict() if report else None,
                "table": report.table if report else "", "source": f"plan file {config.plan}"}
    if resumed_plan is not None:
        kept = resumed_fields(resumed_plan, config, world_size, work.layer_names)
        if kept is not None:
            return {"fields": _users_zero(kept, config), "report": None, "table": "",
                    "source": "the resumed checkpoint"}
    inputs = _search_inputs(config, world_size, work, network)
    options = replace(_profile_options(work), space=inputs.space, tp=inputs.tp,
                      tp_plan=config.tp_plan if config.tp is None else None, precision=config.precision)
    try:
        with held_in(work.net, dtype_of(config.precision)):  # profiled in the dtype it will compute in
            result = plan_model(work.net, as_computed(work.x, config.precision), world_size, batching.num_rows(work.x),
                                inputs.cluster, options)
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
    """A replayed layout with Config.zero, Config.offload and Config.batch_weight_grads in place of
    the saved ones, where given."""
    fields = fields if config.zero is None else {**fields, "zero": config.zero}
    fields = fields if config.offload is None else {**fields, "offload": config.offload == "optimizer"}
    return fields if config.batch_weight_grads is None else {**fields, "batch_weight_grads": config.batch_weight_grads}


def _search_inputs(config: Config, world_size: int, work: Workload, network: Network | None) -> SearchInputs:
    """What the search may choose and what it prices with (`plait.planner.choice`: the command's too)."""
    preset = preset_of(work.device)  # GPU ranks: their host link and host memory (offload's prices)
    return search_inputs(config, world_size, batching.num_rows(work.x), local_world_size(world_size),
                         state_factor(work.optimizer), network, dist.get_backend() if dist.is_initialized() else "",
                         (preset.host_link, preset.host_bandwidth))


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
        with held_in(work.net, dtype_of(config.precision)):
            profile_sample(work.net, as_computed(work.x, config.precision), world_size, _profile_options(work))
    except Exception as error:  # noqa: BLE001 - rank 0 raises the same error in its own profile
        log.debug("plait: rank-side profile failed (rank 0 reports it): %s", error)


def _optimizer_factory(optimizer: Any) -> Any:
    if isinstance(optimizer, torch.optim.Optimizer):
        kind, defaults = type(optimizer), dict(optimizer.defaults)
        return lambda params: kind(params, **defaults)
    return optimizer if callable(optimizer) else torch.optim.Adam
