"""Config's checks of stages of different widths (tp_per_stage, dp_per_stage): what each needs and refuses."""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError
from plait.plan.plan import CROSSINGS

__all__ = ["check_tp_per_stage", "check_dp_per_stage", "stage_lanes"]


# Each check takes the `plait.config.Config` being made (typed Any: plait.config imports this module).


def _widths(config: Any, name: str, example: str) -> tuple[int, ...] | None:
    """The field `name` as a tuple of positive integers (None: not given)."""
    widths: Any = getattr(config, name)
    if widths is None:
        return None
    if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__") or not tuple(widths) or any(
            not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
        what = "tp" if name == "tp_per_stage" else "dp (data-parallel replicas)"
        raise ConfigError(f"{name} must list one positive {what} per stage, e.g. {example}, got {widths!r}")
    out = tuple(widths)
    object.__setattr__(config, name, out)
    return out


def _check_cut(config: Any, name: str, widths: tuple[int, ...]) -> None:
    cut = len(config.layers_per_proc or ()) or (None if config.split_points is None else len(config.split_points) + 1)
    if cut != len(widths):
        raise ConfigError(f"{name}={list(widths)} gives {len(widths)} stages but the cut gives "
                          f"{cut or 'none'}; give layers_per_proc (or split_points) "
                          f"for exactly {len(widths)} stages")


def _refused(config: Any) -> dict[str, bool]:
    """The fields stages of different widths do not run with, and whether each is set."""
    return {"zero": bool(config.zero), "num_virtual_stages": config.num_virtual_stages != 1,
            "tp_plan": config.tp_plan is not None, "sequence_parallel": config.sequence_parallel,
            "replan": bool(config.replan),
            "plan": config.plan is not None}


def check_tp_per_stage(config: Any) -> None:
    """tp_per_stage: one positive tp per stage of a given cut, in a layout that supports it."""
    if config.crossing not in (None, *CROSSINGS):
        raise ConfigError(f"crossing={config.crossing!r}; use 'tiles' (each value once over the link, then a "
                          "local all-gather), 'whole' (every receiving rank gets all of it) or None")
    if config.crossing is not None and config.dp_per_stage is not None:
        raise ConfigError(f"crossing={config.crossing!r} is for stages of different tp widths (tp_per_stage); "
                          "stages of different dp widths always send their rows; leave crossing=None")
    widths = _widths(config, "tp_per_stage", "(2, 1)")
    if widths is None:
        return
    refused = {"tp": config.tp not in (None, 1), **_refused(config),
               "zero": bool(config.zero) and config.dp in (None, 1)}  # ZeRO over the pipeline's replicas
    bad = {name: getattr(config, name) for name, is_bad in refused.items() if is_bad}
    if bad:
        raise ConfigError(f"tp_per_stage={list(widths)} (stages of different widths) does not run with {bad}; "
                          "leave those fields at their defaults (zero needs dp > 1), or give one tp for every stage")
    _check_cut(config, "tp_per_stage", widths)


def check_dp_per_stage(config: Any) -> None:
    """dp_per_stage: one positive replica count per stage of a given cut, unsplit (tp=1), in a layout
    that supports it; tp (None: not planned here) is set to 1."""
    widths = _widths(config, "dp_per_stage", "(2, 1)")
    if widths is None:
        return
    refused = {"tp_per_stage": config.tp_per_stage is not None, "tp": config.tp not in (None, 1),
               "dp": config.dp not in (None, 1), "grad_reduction": config.grad_reduction != "mean",
               **_refused(config), "zero": bool(config.zero) and max(widths) == 1}  # ZeRO needs a stage's replicas
    bad = {name: getattr(config, name) for name, is_bad in refused.items() if is_bad}
    if bad:
        raise ConfigError(f"dp_per_stage={list(widths)} (stages of different data-parallel widths) does not run "
                          f"with {bad}; leave those fields at their defaults (tp=1, dp=1, grad_reduction='mean'), "
                          "or give one dp for every stage (Config(dp=...))")
    _check_cut(config, "dp_per_stage", widths)
    object.__setattr__(config, "tp", 1)  # unsplit stages: the planner prices no tp


def stage_lanes(config: Any, world_size: int) -> int | None:
    """With stages of different widths: the stages (one lane each) x the pipeline's replicas
    (tp_per_stage with dp), once the world size is checked against the widths' sum x dp; None
    otherwise."""
    for name in ("tp_per_stage", "dp_per_stage"):
        widths: tuple[int, ...] | None = getattr(config, name)
        if widths is not None:
            dp = (config.dp or 1) if name == "tp_per_stage" else 1
            if world_size != sum(widths) * dp:
                what = f"their sum x dp={dp}" if dp > 1 else "their sum"
                raise ConfigError(f"{name}={list(widths)} needs {sum(widths) * dp} ranks ({what}) but the world "
                                  f"size is {world_size}; launch {sum(widths) * dp} ranks")
            return len(widths) * dp
    return None
