"""A Model's start on its rank: the net checked and placed, and the stages it runs before any planning."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from plait.config import Config
from plait.errors import ConfigError
from plait.materialize import on_meta
from plait.train.rank_build import RELEASED

__all__ = ["place_net", "starting_stages"]

log = logging.getLogger("plait")


def place_net(net: nn.Module, optimizer: Any, device: torch.device) -> bool:
    """Whether `net` is built on the meta device (each rank then materializes its stages); a real net
    moves to `device`. Refused: a net an earlier Model freed, an optimizer over meta parameters."""
    if getattr(net, RELEASED, False):
        raise ConfigError(f"this {type(net).__name__} was trained by an earlier plait.Model, which freed on "
                          "each rank the parameters its stages do not use: build the module again for a "
                          "new Model, or give the earlier one an optimizer instance (nothing is freed then)")
    meta = on_meta(net)
    if meta and isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("the optimizer was made over parameters on the meta device, which plait "
                          "replaces by real ones: pass a callable, optimizer=lambda params: "
                          "torch.optim.Adam(params, ...), and plait makes it over this rank's")
    if device.type != "cpu" and not meta:
        net.to(device)
    return meta


def starting_stages(config: Config, world_size: int) -> tuple[Config, int]:
    """The config a rank runs and its pipeline stages until planned: one process (no launcher) runs
    every layer on one stage; several ranks have 0 until planned (`plait.planner.layout`), or the
    size given, checked against the world now."""
    if world_size == 1:
        asked = max(config.num_stages or 1, len(config.layers_per_stage or ()), len(config.split_points or ()) + 1)
        if asked > 1 or (config.tp or 1) > 1 or config.stage_tp or config.stage_dp:  # stages asked for, by size or by cut (Config checks that they agree)
            log.warning("plait: one process (no launcher): running every layer on one stage")
            config = dataclasses.replace(config, tp=1, tp_plan=None, stage_tp=None, stage_dp=None)
        return config, 1
    lanes = config.lanes(world_size)  # pp x dp: the ranks of one tensor-parallel part
    return config, 0 if config.plans_everything else config.stages_for(lanes)
