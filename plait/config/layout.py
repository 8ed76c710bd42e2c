"""Config's checks of the layout: tensor parallelism, the cut and its stages, ZeRO, the schedule and recomputation."""

from __future__ import annotations

from typing import Any

from plait.capture.tp_layout import TP_PLACEMENT, TP_STRATEGIES
from plait.errors import ConfigError
from plait.schedule.registry import SCHEDULE_NAMES, schedule_spec, virtual_hint

__all__ = ["check_tp", "check_layout", "check_zero", "check_schedule", "check_recompute"]


# Each check takes the `plait.config.Config` being made (typed Any: plait.config imports this module).


def check_tp(config: Any) -> None:
    """tp: a positive integer; tp_plan: {pattern: strategy} (kept as a tuple of its items)."""
    if config.tp is not None and (not isinstance(config.tp, int) or isinstance(config.tp, bool) or config.tp < 1):
        raise ConfigError(f"tp must be a positive integer (tensor-parallel ranks per stage) or None (the "
                          f"planner chooses), got {config.tp!r}")
    if not isinstance(config.sequence_parallel, bool):
        raise ConfigError(f"sequence_parallel must be True or False, got {config.sequence_parallel!r}")
    plan = config.tp_plan
    if plan is None:
        return
    items = tuple(plan.items()) if isinstance(plan, dict) else tuple(tuple(x) for x in plan)
    bad = [(k, v) for k, v in items if not isinstance(k, str) or not isinstance(v, str)
           or (v not in TP_STRATEGIES and not TP_PLACEMENT.fullmatch(v))]
    if bad:
        raise ConfigError(f"tp_plan entries {bad} are not pattern: strategy; a strategy is one of "
                          f"{TP_STRATEGIES} or the weight's placement ('Shard(0)', 'Shard(1)', 'Replicate()'), "
                          f"e.g. tp_plan={{'*.mlp.c_fc': 'colwise'}}")
    if config.tp == 1:
        raise ConfigError(f"tp_plan={ {k: v for k, v in items} } splits modules over tensor-parallel ranks, but tp=1; set tp > 1")
    object.__setattr__(config, "tp_plan", items)


def check_layout(config: Any) -> None:
    """layers_per_stage, split_points, num_stages and dp: sizes, and the cut against the stages."""
    if config.layers_per_stage is not None:
        _check_layers(config)
    if config.split_points is not None:
        _check_split_points(config)
    if config.num_stages is not None and (not isinstance(config.num_stages, int) or config.num_stages < 1):
        raise ConfigError(f"num_stages must be a positive integer or None, got {config.num_stages!r}")
    if config.dp is not None and (not isinstance(config.dp, int) or isinstance(config.dp, bool) or config.dp < 1):
        raise ConfigError(f"dp must be a positive integer (data-parallel replicas), got {config.dp!r}")


def _check_layers(config: Any) -> None:
    given = config.layers_per_stage
    if given is None:
        return
    if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
        raise ConfigError(f"layers_per_stage must be a list of layer counts, one per stage, got {given!r}; "
                          "for example layers_per_stage=[2, 3, 3]")
    counts = tuple(given)
    bad = [c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]
    if not counts or bad:
        raise ConfigError(f"layers_per_stage={list(counts)} must hold one positive integer per stage "
                          f"(bad entries: {bad}); every stage needs at least one layer")
    object.__setattr__(config, "layers_per_stage", counts)
    v = config.num_virtual_stages if isinstance(config.num_virtual_stages, int) else 1
    if v > 1 and len(counts) % v:
        raise ConfigError(f"layers_per_stage={list(counts)} has {len(counts)} entries, not a multiple of "
                          f"num_virtual_stages={v}; with interleaving it lists every model chunk "
                          f"(num_stages x {v} entries)")
    if v > 1 and config.num_stages is not None and config.num_stages * v != len(counts):
        raise ConfigError(f"num_stages={config.num_stages} x num_virtual_stages={v} = {config.num_stages * v} "
                          f"chunks but layers_per_stage={list(counts)} has {len(counts)} entries; make them agree")
    if v == 1 and config.num_stages is not None and config.num_stages != len(counts):
        raise ConfigError(f"num_stages={config.num_stages} but layers_per_stage={list(counts)} has "
                          f"{len(counts)} entries; give one of them, or make them agree")


def _check_split_points(config: Any) -> None:
    """split_points: a list of distinct names, not with layers_per_stage, against the stages."""
    points = config.split_points
    if points is None:
        return
    if isinstance(points, (str, bytes)) or not hasattr(points, "__iter__"):
        raise ConfigError(f"split_points must be a list of module names, each starting a new stage, got "
                          f"{points!r}; for example split_points=['model.layers.6'] (names as in net.named_modules())")
    names = tuple(points)
    bad = [p for p in names if not isinstance(p, str) or not p]
    if bad:
        raise ConfigError(f"split_points={list(names)} must hold module names, non-empty strings as in "
                          f"net.named_modules() (bad entries: {bad})")
    twice = sorted({p for p in names if names.count(p) > 1})
    if twice:
        raise ConfigError(f"split_points={list(names)} names {twice} more than once; each name starts one "
                          "stage: list it once")
    object.__setattr__(config, "split_points", names)
    if config.layers_per_stage is not None:
        raise ConfigError(f"split_points={list(names)} and layers_per_stage={list(config.layers_per_stage)} both "
                          "give the cut; keep one of them (split_points names the module each stage after "
                          "the first starts at, layers_per_stage counts the layers of each stage)")
    chunks = len(names) + 1
    v = config.num_virtual_stages if isinstance(config.num_virtual_stages, int) else 1
    if v > 1 and chunks % v:
        raise ConfigError(f"split_points={list(names)} cut the model into {chunks} chunks, not a multiple of "
                          f"num_virtual_stages={v}; with interleaving name num_stages x {v} - 1 points")
    if v > 1 and config.num_stages is not None and config.num_stages * v != chunks:
        raise ConfigError(f"num_stages={config.num_stages} x num_virtual_stages={v} = {config.num_stages * v} "
                          f"chunks but split_points={list(names)} cut {chunks}; name "
                          f"{config.num_stages * v - 1} points, or make num_stages agree")
    if v == 1 and config.num_stages is not None and config.num_stages != chunks:
        raise ConfigError(f"num_stages={config.num_stages} but split_points={list(names)} cut {chunks} stages "
                          f"(one more than the points); give one of them, or name {config.num_stages - 1} points")


def check_zero(config: Any) -> None:
    """zero: None, 0, 1, 2 or 3, above 0 only with more than one replica; 3 in the layouts its
    runtime runs (tp, when open, is set to 1)."""
    if config.zero is None:
        return
    if isinstance(config.zero, bool) or config.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero must be 0, 1, 2, 3 or None, got {config.zero!r}")
    if config.zero and config.dp == 1 and max(config.stage_dp or (1,)) == 1:
        raise ConfigError(f"zero={config.zero} shards over a stage's replicas, but dp=1 has "
                          "one replica; set dp > 1 or zero=0")
    if config.zero == 3:
        _check_zero3(config)


def _check_zero3(config: Any) -> None:
    """What zero=3 does not run with yet, refused by name."""
    refused = {
        "stage_tp": config.stage_tp is not None,
        "stage_dp": config.stage_dp is not None,
        "replan": bool(config.replan),
    }
    bad = {name: getattr(config, name) for name, is_bad in refused.items() if is_bad}
    if bad:
        raise ConfigError(f"zero=3 (parameters sharded over the replicas) does not run with {bad} yet; leave "
                          "those at their defaults (one width for every stage, no replanning), or use zero=2")


def check_schedule(config: Any) -> None:
    """num_microbatches, schedule and num_virtual_stages."""
    m = config.num_microbatches
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
        raise ConfigError(f"num_microbatches must be a positive integer, got {config.num_microbatches!r}")
    if config.schedule is not None and config.schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"schedule={config.schedule!r} is not known; choose one of {list(SCHEDULE_NAMES)}")
    v = config.num_virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"num_virtual_stages must be a positive integer, got {v!r}")
    if v > 1 and (config.schedule is None or not schedule_spec(config.schedule).virtual):
        raise ConfigError(
            f"num_virtual_stages={v} needs {virtual_hint()}, got schedule="
            f"{config.schedule or '1f1b'!r}{'' if config.schedule else ' (the default)'}"
        )


def check_recompute(config: Any) -> None:
    for name, words in (("recompute", ("auto",)), ("recompute_by_layer", ())):
        r = getattr(config, name)
        if r is None or isinstance(r, bool) or r in words:
            continue
        if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
            known = ", ".join(["True", "False", *(repr(w) for w in words)])
            raise ConfigError(f"{name}={r!r} is not known; use {known} or a list of stage indices")
        stages = tuple(r)
        bad = [s for s in stages if not isinstance(s, int) or isinstance(s, bool) or s < 0]
        if bad:
            raise ConfigError(f"{name}={list(stages)} must list stage indices >= 0 (bad entries: {bad})")
        object.__setattr__(config, name, stages)
