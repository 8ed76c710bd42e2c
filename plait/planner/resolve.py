"""Resolving a run's layout into a complete `Plan`: every stage's layers, micro-batches, schedule, recomputation.

The user's `Config` and the planner's choice (a candidate as Config fields, `plait.planner.layout`)
and the captured layers become the `Plan` the runtime builds from, so that pipeline assembly only
assembles: no partition, no default and no recomputation decision is left to it.

    one process          one stage of every layer (a size given is ignored, with a warning)
    layers_per_stage     the user's or the planner's cut, checked against the uncuttable regions
    split_points         the user's cut by module names, to layer counts (`plait.search.split_points`)
    none (one rank each) a balanced cut by parameter count (num_stages given, search not possible)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch
from torch import nn

from plait.capture.split import split, stage_of_layers, tied_parameters
from plait.capture.tp_layout import TpLayout
from plait.capture.trace import CapturedGraph
from plait.config import Config
from plait.errors import ConfigError, PartitionError
from plait.plan import Plan
from plait.planner.tp_search import device_search, searched_layouts
from plait.runtime.tp.layouts import layouts_data, width_groups
from plait.schedule import simulate
from plait.search.partition import balance, check_partition
from plait.search.split_points import cut_at

__all__ = ["resolve_plan", "complete_plan", "recomputed_stages"]


def _zero(config: Config, world_size: int) -> int:
    """Config.zero on the resolved layout: the user's level, or the planner's choice (a planned
    layout's config sets it, `plait.planner.layout`); None (not planned) is 0; 1 and 2 need more
    than one replica (of some stage, with stage_dp)."""
    if not config.zero or world_size == 1:
        return 0
    if config.dp == 1 and max(config.stage_dp or (1,)) == 1:
        raise ConfigError(f"zero={config.zero} shards over a stage's replicas, but the layout "
                          f"has dp=1 on {world_size} ranks; set dp > 1 or zero=0")
    return config.zero


def resolve_plan(config: Config, world_size: int, captured: CapturedGraph, net: nn.Module,
                 chosen: Mapping[str, Any] | None = None) -> Plan:
    """The plan of `config` on `world_size` ranks for `captured`, with the planner's `chosen` layout
    (a candidate as Config fields, `plait.planner.choice.candidate_fields`; JSON lists taken) in
    place of what the config leaves open or lets it choose; what neither sets takes its default."""
    config = _with_choice(config, chosen or {})
    lanes = config.lanes(world_size)  # the pp x dp ranks of each tensor-parallel part
    pp = config.stages_for(lanes) if lanes > 1 else 1
    virtual = config.num_virtual_stages if lanes > 1 else 1
    num_chunks = pp * virtual  # model stages (chunks), num_virtual_stages per rank
    names = captured.layers.layer_names
    regions = captured.layers.uncuttable
    if num_chunks > len(names):
        raise PartitionError(
            f"{num_chunks} stages ({pp} ranks x num_virtual_stages={virtual}) "
            f"but the model has only {len(names)} layers ({', '.join(names)}); use at most "
            f"{len(names) // virtual} ranks per pipeline or fewer virtual stages"
        )
    if config.layers_per_stage is not None and pp > 1:
        layers = tuple(config.layers_per_stage)
        check_partition(layers, names, regions)
    elif config.split_points is not None and pp > 1:
        layers = cut_at(config.split_points, names, regions)
    else:
        layers = tuple(balance([1.0 + _layer_params(net, name) for name in names], num_chunks, regions))
    assert config.num_microbatches is not None and config.schedule is not None and config.dp is not None
    widths = tuple(config.stage_tp or ())  # stages of different widths (Config.stage_tp)
    recomputed = recomputed_stages(config, num_chunks, virtual)
    return Plan(
        layer_names=names,
        layers_per_stage=layers,
        num_microbatches=config.num_microbatches,
        schedule=config.schedule,
        world_size=world_size,
        capture_method=captured.method,
        kept_whole=captured.kept_whole,
        zero=_zero(config, lanes),
        tp=max(widths) if widths else config.tp or 1,
        stage_tp=widths if len(set(widths)) > 1 else (),  # equal widths: the uniform grid
        crossing=config.crossing or "tiles",
        stage_dp=tuple(config.stage_dp or ()),  # stages of their own replica counts (Config.stage_dp)
        batch_weight_grads=bool(config.batch_weight_grads),
        tp_plan=tuple(config.tp_plan or ()),
        sequence_parallel=config.sequence_parallel,
        precision=config.precision,
        uncuttable=regions,
        dp=config.dp,
        num_virtual_stages=virtual,
        recompute=recomputed,
        recompute_by_layer=_by_layer(config, recomputed),
    )



def _with_choice(config: Config, chosen: Mapping[str, Any]) -> Config:
    """`config` with the chosen fields, every size set."""
    fields: dict[str, Any] = {name: tuple(value) if isinstance(value, list) else value
                              for name, value in chosen.items()}
    if not fields:
        return config.with_defaults()
    if fields.get("tp", 1) == 1:  # no tp chosen: no tp plan
        fields["tp_plan"] = None
    return replace(config, **fields, plan=None).with_defaults()  # a plan file is applied


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

def recomputed_stages(config: Config, num_chunks: int, num_virtual_stages: int) -> tuple[int, ...]:
    """The stages that recompute their forward, from `config.recompute` (see Config).

    "auto" picks the stages whose rank holds activations of more than one micro-batch at once
    under the schedule (the simulator's peak, with unit costs): there recomputation saves
    memory; on a stage that holds one micro-batch at a time it would only cost a forward.
    """
    r = config.recompute
    if r is False or r is None:
        return ()
    if r is True:
        return tuple(range(num_chunks))
    if r == "auto":
        pp = num_chunks // num_virtual_stages
        sim = simulate(config.schedule or "1f1b", pp, config.num_microbatches or 1, t_f=1.0, t_b=1.0,
                       num_virtual_stages=num_virtual_stages)
        return tuple(s for s in range(num_chunks) if sim.peak_activations[s % pp] > 1)
    assert isinstance(r, tuple)
    unknown = [s for s in r if s >= num_chunks]
    if unknown:
        raise ConfigError(
            f"recompute={list(r)} names stages {unknown}, but the model has {num_chunks} stages "
            f"(0..{num_chunks - 1}); list existing stages or use recompute=True / 'auto'"
        )
    return tuple(sorted(set(r)))


def _by_layer(config: Config, recomputed: tuple[int, ...]) -> tuple[int, ...]:
    """The recomputed stages that recompute layer by layer, from `config.recompute_by_layer`."""
    r = config.recompute_by_layer
    if r is True:
        return recomputed
    if not r:
        return ()
    assert isinstance(r, tuple)
    stray = sorted(set(r) - set(recomputed))
    if stray:
        raise ConfigError(f"recompute_by_layer={list(r)} names stages {stray} that do not recompute "
                          f"(recomputed: {list(recomputed)}); list recomputed stages or use True")
    return tuple(sorted(set(r)))


def _layer_params(net: nn.Module, layer_name: str) -> float:
    """Parameters of the module a layer is named after (a layer's weight in a balanced cut)."""
    module_name = layer_name.split("#")[0]
    try:
        module = net.get_submodule("" if module_name == "<net>" else module_name)
    except AttributeError:
        return 0.0
    return float(sum(p.numel() for p in module.parameters()))


