"""Resolving a run's layout into a complete `Plan`: every stage's layers, micro-batches, schedule, recomputation.

The user's `Config`, the chosen candidate (the search's best, a plan file's or a resumed checkpoint's,
read by its `LAYOUT_KEYS`: it never becomes a Config) and the captured layers become the `Plan` the
runtime builds from, so that pipeline assembly only assembles: no partition, no default and no
recomputation decision is left to it.

    one process          one stage of every layer (a size given is ignored, with a warning)
    layers_per_stage     the user's or the planner's cut, checked against the uncuttable regions
    split_points         the user's cut by module names, to layer counts (`plait.search.split_points`)
    none (one rank each) a balanced cut by parameter count (num_stages given, search not possible)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

import torch
from torch import nn

from plait.capture.split import split, stage_of_layers, tied_parameters
from plait.capture.tp_layout import TpLayout
from plait.capture.trace import CapturedGraph
from plait.config import UNPLANNED, Config
from plait.errors import ConfigError, PartitionError
from plait.plan import Plan
from plait.plan.mesh import Mesh
from plait.planner.tp_search import device_search, searched_layouts
from plait.runtime.tp.layouts import layouts_data, width_groups
from plait.schedule import simulate
from plait.search.partition import balance, check_partition
from plait.search.split_points import cut_at

__all__ = ["LAYOUT_KEYS", "layout_keys", "resolve_plan", "complete_plan", "recomputed_stages"]


#: The layout keys of a candidate, as the planner's JSON names them (`Candidate.to_dict()`, a plan
#: file, a resumed checkpoint's plan): what `resolve_plan` reads of it; a key absent or None is left
#: to the user's Config. recompute is True/False (every stage or none) or the recomputed stages.
LAYOUT_KEYS = ("layers_per_stage", "pp", "dp", "tp", "num_microbatches", "schedule", "num_virtual_stages",
               "recompute", "recompute_by_layer", "zero", "batch_weight_grads", "stage_tp", "stage_dp", "crossing",
               "offload")


def layout_keys(candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The layout keys of `candidate` (a planner candidate's JSON, or a saved plan's), others dropped."""
    return {key: candidate[key] for key in LAYOUT_KEYS if key in candidate}


def resolve_plan(config: Config, world_size: int, captured: CapturedGraph, net: nn.Module,
                 chosen: Mapping[str, Any] | None = None) -> Plan:
    """The plan of `config` on `world_size` ranks for `captured`, with the `chosen` candidate's layout
    (`LAYOUT_KEYS`; JSON lists taken) in place of what the config leaves open or lets it choose;
    what neither sets takes its default. The candidate is read here, once, into the Plan."""
    pick = _picker(chosen or {}, config)
    dp = int(pick("dp"))
    widths = pick("stage_tp") or ()  # stages of different widths (Config.stage_tp)
    stage_dp = pick("stage_dp") or ()  # stages of their own replica counts (Config.stage_dp)
    tp = int(max(widths) if widths else pick("tp"))
    cut = pick("layers_per_stage")
    split_points = None if cut is not None else config.split_points
    given = pick("pp")
    lanes = Mesh.widths_lanes(world_size, widths, stage_dp, dp) or Mesh.lanes_of(world_size, tp, given, dp)
    virtual = int(pick("num_virtual_stages")) if lanes > 1 else 1
    named = (f"layers_per_stage={None if cut is None else list(cut)}" if split_points is None
             else f"split_points={list(split_points)}")  # where the stages came from, for the Mesh's error
    pp = 1 if lanes == 1 else Mesh.pp_of(lanes, dp, Mesh.stages_of_cut(cut, split_points, given, virtual), tp,
                                         f"{named}, num_stages={given}, ")
    num_chunks = pp * virtual  # model stages (chunks), num_virtual_stages per rank
    names = captured.layers.layer_names
    regions = captured.layers.uncuttable
    if num_chunks > len(names):
        raise PartitionError(
            f"{num_chunks} stages ({pp} ranks x num_virtual_stages={virtual}) "
            f"but the model has only {len(names)} layers ({', '.join(names)}); use at most "
            f"{len(names) // virtual} ranks per pipeline or fewer virtual stages"
        )
    if cut is not None and pp > 1:
        layers = tuple(int(n) for n in cut)
        check_partition(layers, names, regions)
    elif split_points is not None and pp > 1:
        layers = cut_at(split_points, names, regions)
    else:
        layers = tuple(balance([1.0 + _layer_params(net, name) for name in names], num_chunks, regions))
    m, schedule = int(pick("num_microbatches")), str(pick("schedule"))
    recomputed = recomputed_stages(pick("recompute"), schedule, m, num_chunks, virtual)
    return Plan(
        layer_names=names,
        layers_per_stage=layers,
        num_microbatches=m,
        schedule=schedule,
        world_size=world_size,
        capture_method=captured.method,
        kept_whole=captured.kept_whole,
        zero=_zero(pick("zero"), dp, stage_dp, lanes),
        tp=tp,
        stage_tp=widths if len(set(widths)) > 1 else (),  # equal widths: the uniform grid
        crossing=str(pick("crossing") or "tiles"),
        stage_dp=stage_dp,
        batch_weight_grads=bool(pick("batch_weight_grads")),
        tp_plan=tuple(config.tp_plan or ()) if tp > 1 else (),
        sequence_parallel=config.sequence_parallel,
        precision=config.precision,
        offload=bool(pick("offload")),  # the candidate's, or Config.offload ("optimizer": True)
        uncuttable=regions,
        dp=dp,
        num_virtual_stages=virtual,
        recompute=recomputed,
        recompute_by_layer=_by_layer(pick("recompute_by_layer"), recomputed),
    )


def _picker(chosen: Mapping[str, Any], config: Config) -> Callable[[str], Any]:
    """pick(key): the candidate's layout value (a JSON list as a tuple), else the user's Config's
    (`pp` is its num_stages), else what an open field takes unplanned (`plait.config.UNPLANNED`)."""
    def pick(key: str) -> Any:
        value = chosen.get(key)
        if value is None:
            value = getattr(config, "num_stages" if key == "pp" else key)
        if value is None:
            return UNPLANNED.get(key)
        return tuple(value) if isinstance(value, list) else value
    return pick


def _zero(zero: int | None, dp: int, stage_dp: tuple[int, ...], lanes: int) -> int:
    """The ZeRO level of the resolved layout: the user's, or the planner's choice; None (not
    planned) is 0; 1-3 need more than one replica (of some stage, with stage_dp)."""
    if not zero or lanes == 1:
        return 0
    if dp == 1 and max(stage_dp or (1,)) == 1:
        raise ConfigError(f"zero={zero} shards over a stage's replicas, but the layout "
                          f"has dp=1 on {lanes} ranks; set dp > 1 or zero=0")
    return int(zero)


def complete_plan(plan: Plan, captured: CapturedGraph, memory_limit_bytes: float | None = None,
                  device: torch.device = torch.device("cpu"), state_factor: float = 4.0) -> Plan:
    """`plan` with what follows from its stage graphs: the parameters tied across stages, and with
    tp > 1 each stage's tp layout -- under `memory_limit_bytes` what the tp search splits, priced
    with `device`'s preset and `state_factor` bytes of state per parameter byte
    (`plait.planner.tp_search`), else everything that splits. The runtime lays the stages out as
    these say (`plait.runtime.tp.layouts`): it chooses nothing."""
    stages = split(captured, stage_of_layers(plan.layers_per_stage))
    plan = replace(plan, tied_parameters=tuple((name, ss) for name, _, ss in tied_parameters(stages, captured.root)))
    if plan.tp == 1:
        return plan
    layouts: dict[int, TpLayout] = {}
    for width, chosen, tp_plan in width_groups(stages, plan):
        search = device_search(memory_limit_bytes, width, plan.num_virtual_stages, device, state_factor)
        layouts.update(zip(chosen, searched_layouts([stages[s].module for s in chosen], width, tp_plan, search,
                                                    sequence_parallel=plan.sequence_parallel)))
    return replace(plan, tp_layouts=layouts_data(stages, layouts))

def recomputed_stages(recompute: Any, schedule: str, num_microbatches: int, num_chunks: int,
                      num_virtual_stages: int) -> tuple[int, ...]:
    """The stages that recompute their forward, from `recompute` (Config.recompute: True, False,
    None, "auto" or the stages).

    "auto" picks the stages whose rank holds activations of more than one micro-batch at once
    under the schedule (the simulator's peak, with unit costs): there recomputation saves
    memory; on a stage that holds one micro-batch at a time it would only cost a forward.
    """
    r = recompute
    if r is False or r is None:
        return ()
    if r is True:
        return tuple(range(num_chunks))
    if r == "auto":
        pp = num_chunks // num_virtual_stages
        sim = simulate(schedule, pp, num_microbatches, t_f=1.0, t_b=1.0, num_virtual_stages=num_virtual_stages)
        return tuple(s for s in range(num_chunks) if sim.peak_activations[s % pp] > 1)
    r = tuple(int(s) for s in r)
    unknown = [s for s in r if s >= num_chunks]
    if unknown:
        raise ConfigError(
            f"recompute={list(r)} names stages {unknown}, but the model has {num_chunks} stages "
            f"(0..{num_chunks - 1}); list existing stages or use recompute=True / 'auto'"
        )
    return tuple(sorted(set(r)))


def _by_layer(by_layer: Any, recomputed: tuple[int, ...]) -> tuple[int, ...]:
    """The recomputed stages that recompute layer by layer, from `by_layer` (Config.recompute_by_layer)."""
    r = by_layer
    if r is True:
        return recomputed
    if not r:
        return ()
    stray = sorted(set(r) - set(recomputed))
    if stray:
        raise ConfigError(f"recompute_by_layer={list(r)} names stages {stray} that do not recompute "
                          f"(recomputed: {list(recomputed)}); list recomputed stages or use True")
    return tuple(sorted(set(int(s) for s in r)))


def _layer_params(net: nn.Module, layer_name: str) -> float:
    """Parameters of the module a layer is named after (a layer's weight in a balanced cut)."""
    module_name = layer_name.split("#")[0]
    try:
        module = net.get_submodule("" if module_name == "<net>" else module_name)
    except AttributeError:
        return 0.0
    return float(sum(p.numel() for p in module.parameters()))


