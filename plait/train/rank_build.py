"""The build of a rank's pipeline for a layout: its stages' tensors made real, the others freed, the pipeline over them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.materialize import materialize_tensors, release_parameters
from plait.planner.layout import Layout
from plait.runtime.pipeline import Pipeline, build_pipeline, stage_tensors

__all__ = ["RELEASED", "build_rank_pipeline"]

RELEASED = "_plait_released"  # set on a net whose ranks have freed the parameters they do not use


def build_rank_pipeline(model: Any, layout: Layout) -> Pipeline:
    """This rank's training pipeline for `layout`, its stages' tensors real on it.

    `model` is the `plait.Model` building it (typed Any: plait.model imports this module), its
    config already the layout's; its net captured (`_captured`, `_eval_captured`), not yet rebuilt.
    """
    captured, config, net = model._captured, model.config, model.net
    graphs = [g.root for g in (captured, model._eval_captured) if g is not None]
    if model._frees:  # this rank's stages' tensors are real, the others' on meta (freed)
        mine = stage_tensors(captured, layout.plan, model.rank)
        # A real model's freed tensors come back at a new layout from the carried-over checkpoint.
        init = config.init_fn if model._meta else _allocate_only
        if materialize_tensors(net, mine, config.seed, init, model.device, graphs):
            mine = stage_tensors(captured, layout.plan, model.rank)  # the real ones now
        used = {id(t) for t in stage_tensors(captured, layout.plan, None)}  # rank 0 keeps the rest
        unused: list[torch.Tensor] = [p for p in net.parameters() if id(p) not in used] if model.rank == 0 else []
        if release_parameters(net, mine + unused, graphs):
            setattr(net, RELEASED, True)
    elif model._meta:
        materialize_tensors(net, None, config.seed, config.init_fn, model.device, graphs)
    first = model._train is None and model.world_size > 1 and not model._meta
    pipe = build_pipeline(net, captured, layout.plan, config.execution(), model.rank, model.loss,
                          model.device, first=first)
    if first:  # a meta model's values follow from Config.seed; a real one's replicas start equal whatever their seeds
        pipe.start_equal()
    return pipe


def _allocate_only(module: nn.Module) -> None:
    """The initialiser of tensors whose values are about to be restored: none."""
