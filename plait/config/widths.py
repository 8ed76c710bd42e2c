"""Config's checks of stages of different widths (stage_tp, stage_dp): what each needs and refuses."""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError
from plait.plan.plan import CROSSINGS

__all__ = ["check_stage_tp", "check_stage_dp"]


# Each check takes the `plait.config.Config` being made (typed Any: plait.config imports this module).


def _widths(config: Any, name: str, example: str) -> tuple[int, ...] | None:
    """The field `name` as a tuple of positive integers (None: not given)."""
    widths: Any = getattr(config, name)
    if widths is None:
        return None
    if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__") or not tuple(widths) or any(
            not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
        what = "tp" if name == "stage_tp" else "dp (data-parallel replicas)"
        raise ConfigError(f"{name} must list one positive {what} per stage, e.g. {example}, got {widths!r}")
    out = tuple(widths)
    object.__setattr__(config, name, out)
    return out


def _check_cut(config: Any, name: str, widths: tuple[int, ...]) -> None:
    cut = len(config.layers_per_stage or ()) or (None if config.split_points is None else len(config.split_points) + 1)
    if cut != len(widths):
        raise ConfigError(f"{name}={list(widths)} gives {len(widths)} stages but the cut gives "
                          f"{cut or 'none'}; give layers_per_stage (or split_points) "
                          f"for exactly {len(widths)} stages")


def _refused(config: Any) -> dict[str, bool]:
    """The fields stages of different widths do not run with, and whether each is set."""
    return {"zero": bool(config.zero), "num_virtual_stages": config.num_virtual_stages != 1,
            "tp_plan": config.tp_plan is not None, "sequence_parallel": config.sequence_parallel,
            "replan": bool(config.replan),
            "plan": config.plan is not None}


def check_stage_tp(config: Any) -> None:
    """stage_tp: one positive tp per stage of a given cut, in a layout that supports it."""
    if config.crossing not in (None, *CROSSINGS):
        raise ConfigError(f"crossing={config.crossing!r}; use 'tiles' (each value once over the link, then a "
                          "local all-gather), 'whole' (every receiving rank gets all of it) or None")
    if config.crossing is not None and config.stage_dp is not None:
        raise ConfigError(f"crossing={config.crossing!r} is for stages of different tp widths (stage_tp); "
                          "stages of different dp widths always send their rows; leave crossing=None")
    widths = _widths(config, "stage_tp", "(2, 1)")
    if widths is None:
        return
    refused = {"tp": config.tp not in (None, 1), **_refused(config),
               "zero": bool(config.zero) and config.dp in (None, 1)}  # ZeRO over the pipeline's replicas
    bad = {name: getattr(config, name) for name, is_bad in refused.items() if is_bad}
    if bad:
        raise ConfigError(f"stage_tp={list(widths)} (stages of different widths) does not run with {bad}; "
                          "leave those fields at their defaults (zero needs dp > 1), or give one tp for every stage")
    _check_cut(config, "stage_tp", widths)


def check_stage_dp(config: Any) -> None:
    """stage_dp: one positive replica count per stage of a given cut, unsplit (tp=1), in a layout
    that supports it; tp (None: not planned here) is set to 1."""
    widths = _widths(config, "stage_dp", "(2, 1)")
    if widths is None:
        return
    refused = {"stage_tp": config.stage_tp is not None, "tp": config.tp not in (None, 1),
               "dp": config.dp not in (None, 1), "grad_reduction": config.grad_reduction != "mean",
               **_refused(config), "zero": bool(config.zero) and max(widths) == 1}  # ZeRO needs a stage's replicas
    bad = {name: getattr(config, name) for name, is_bad in refused.items() if is_bad}
    if bad:
        raise ConfigError(f"stage_dp={list(widths)} (stages of different data-parallel widths) does not run "
                          f"with {bad}; leave those fields at their defaults (tp=1, dp=1, grad_reduction='mean'), "
                          "or give one dp for every stage (Config(dp=...))")
    _check_cut(config, "stage_dp", widths)
    object.__setattr__(config, "tp", 1)  # unsplit stages: the planner prices no tp

