"""A layout replayed (a plan file's, `Config(plan=path)`, or a resumed checkpoint's) as a candidate checked against this run.

The candidate is read into its layout keys (`plait.planner.resolve.LAYOUT_KEYS`), as the search's is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.config.aliases import new_names
from plait.errors import ConfigError
from plait.planner.plan_report import PlanReport
from plait.schedule.registry import SCHEDULE_NAMES

__all__ = ["load_plan_file", "resumed_fields", "saved_layout"]


def saved_layout(data: dict[str, Any]) -> dict[str, Any]:
    """The layout keys of a saved candidate or plan (the planner's JSON, `Plan.to_json()`), each
    checked for its type (TypeError, ValueError, KeyError: malformed). recompute is the planner's
    True/False or a plan's recomputed stages."""
    recompute = data.get("recompute", False)
    return {"layers_per_stage": [int(c) for c in data["layers_per_stage"]], "dp": int(data.get("dp", 1)),
            "num_microbatches": int(data["num_microbatches"]), "schedule": str(data["schedule"]),
            "num_virtual_stages": int(data.get("num_virtual_stages", 1)),
            "recompute": recompute if isinstance(recompute, bool) else [int(s) for s in recompute],
            "recompute_by_layer": [int(s) for s in data.get("recompute_by_layer", [])],
            "zero": int(data.get("zero", 0) or 0), "batch_weight_grads": bool(data.get("batch_weight_grads", False)),
            "offload": bool(data.get("offload", False))}


def resumed_fields(plan: dict[str, Any], config: Config, world_size: int,
                    names: tuple[str, ...]) -> dict[str, Any] | None:
    """A resumed checkpoint's layout (its saved Plan's layout keys), when it was saved on this world by
    this model and agrees with what the config fixes; else None (planned afresh)."""
    try:
        if int(plan["world_size"]) != world_size or tuple(plan["layer_names"]) != names:
            return None
        full = saved_layout(plan)
        layers, v, dp = full["layers_per_stage"], full["num_virtual_stages"], full["dp"]
        widths = _width_fields(plan.get("stage_tp"), plan.get("stage_dp"), plan.get("crossing", "tiles"))
    except (KeyError, TypeError, ValueError):
        return None
    full.update(widths or {"pp": len(layers) // v})  # stages of different widths: on their ranks, as saved
    if config.zero and dp == 1:  # the config's ZeRO needs replicas this layout lacks: plan afresh
        return None
    if config.plans_everything:
        return full
    c = config.with_defaults()
    if c.num_virtual_stages == v and c.stages_for(world_size) * v == len(layers):
        return {"layers_per_stage": layers, "zero": full["zero"], "offload": full["offload"]}  # same pp: same dp
    return None


def load_plan_file(path: str, names: tuple[str, ...], world_size: int) -> tuple[dict[str, Any], PlanReport | None]:
    """The layout of a plan file (planner JSON or `Plan.to_json()`) as a candidate, checked against
    this run: ConfigError naming the file and what does not match."""
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
        fields = saved_layout(data)
        if "layer_names" in data:  # Plan.to_json()
            saved_names = tuple(str(n) for n in data["layer_names"])
            saved_world = int(data["world_size"])
        else:  # the planner's JSON (a plan file gives the pp x dp layout; Config.tp gives tp)
            if data.get("feasible") is False:
                raise ConfigError(f"{where}: the plan in the file is infeasible: {data.get('reason')}")
            saved_names = tuple(str(n) for s in data.get("stages", []) for n in s.get("layers", []))
            saved_world = int(data["pp"]) * fields["dp"]
        widths = _width_fields(data.get("stage_tp"), data.get("stage_dp"), data.get("crossing", "tiles"))
        fields.update(widths)  # a pipeline of stages of different widths: on their ranks
        for field, copies in (("stage_tp", fields["dp"]), ("stage_dp", 1)):
            if field in widths:
                saved_world = sum(widths[field]) * copies
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: malformed plan file ({type(e).__name__}: {e})") from None
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
    """The layout keys of a saved pipeline of stages of different widths: its tp per stage (and
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
