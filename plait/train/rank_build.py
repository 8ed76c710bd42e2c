"""The build of a rank's pipeline for a plan: its stages' tensors made real, the others freed, the pipeline over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from plait.capture.trace import CapturedGraph
from plait.config import Config
from plait.job.host_memory import give_back_freed_memory
from plait.capture.split import tied_named
from plait.materialize import defer_parameters, materialize_tensors, release_parameters
from plait.plan import Plan
from plait.runtime.pipeline import Pipeline, build_pipeline, stage_tensors

__all__ = ["RELEASED", "RankPlace", "build_rank_pipeline"]

RELEASED = "_plait_released"  # set on a net whose ranks have freed the parameters they do not use


@dataclass(frozen=True)
class RankPlace:
    """Where a rank builds: its rank and device, whether the net is on meta (each rank makes its
    stages real), whether it frees the tensors its stages do not use, and whether this is the
    first build of a real net (its replicas then start equal)."""

    rank: int
    device: torch.device
    meta: bool
    frees: bool
    first: bool


def build_rank_pipeline(net: nn.Module, graphs: tuple[CapturedGraph | None, CapturedGraph | None], plan: Plan,
                        config: Config, place: RankPlace, loss: Callable[[Any, Any], torch.Tensor] | None) -> Pipeline:
    """This rank's training pipeline for `plan`, its stages' tensors real on it.

    `graphs`: the net captured for training and, where made (a meta net), for evaluation; `config`
    gives the initialiser, the seed and the runtime's settings (`Config.execution`)."""
    captured, _ = graphs
    assert captured is not None
    if plan.zero == 3:  # its layers' buffers come and go: freed memory goes back (`plait.job.host_memory`)
        give_back_freed_memory()
    roots = [g.root for g in graphs if g is not None]
    deferred = None
    if place.frees:  # this rank's stages' tensors are real, the others' on meta (freed)
        mine = stage_tensors(captured, plan, place.rank)
        # A real model's freed tensors come back at a new layout from the carried-over checkpoint.
        init = config.init_fn if place.meta else _allocate_only
        later = _sharded_later(captured, plan, mine) if place.meta else {}
        if materialize_tensors(net, [t for t in mine if id(t) not in later], config.seed, init, place.device, roots):
            mine = stage_tensors(captured, plan, place.rank)  # the real ones now
        if later:  # zero=3: each layer's made real as it is sharded (`plait.runtime.dp.sharded_params`)
            deferred = defer_parameters(net, later.values(), config.seed, config.init_fn, place.device, roots)
            mine = stage_tensors(captured, plan, place.rank)
        used = {id(t) for t in stage_tensors(captured, plan, None)}  # rank 0 keeps the rest
        unused: list[torch.Tensor] = [p for p in net.parameters() if id(p) not in used] if place.rank == 0 else []
        if release_parameters(net, mine + unused, roots):
            setattr(net, RELEASED, True)
    elif place.meta:
        materialize_tensors(net, None, config.seed, config.init_fn, place.device, roots)
    pipe = build_pipeline(net, captured, plan, config.execution(), place.rank, loss, place.device, first=place.first,
                          fill=None if deferred is None else deferred.fill)
    if deferred is not None:  # what the sharding did not take (none): whole, with its values
        deferred.fill(list(deferred.pending.values()))
    if place.first:  # a meta model's values follow from Config.seed; a real one's replicas start equal whatever their seeds
        pipe.start_equal()
    return pipe


def _sharded_later(captured: CapturedGraph, plan: Plan, mine: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """zero=3: this rank's meta parameters its stages shard (all but those tied across stages, which
    stay whole), made real only as their layer is sharded: a rank never holds its whole stage (with
    tp, each layer's tp part is cut from its whole values as it is filled)."""
    if plan.zero != 3:
        return {}
    tied = {id(p) for p, _ in tied_named(captured.root, plan.tied_parameters)}
    return {id(t): t for t in mine if isinstance(t, nn.Parameter) and t.is_meta and id(t) not in tied}


def _allocate_only(module: nn.Module) -> None:
    """The initialiser of tensors whose values are about to be restored: none."""
