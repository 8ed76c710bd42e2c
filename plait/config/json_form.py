"""Config's JSON form: its fields as plain JSON-ready values, and the Config made back from them."""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from typing import Any

from plait.config.aliases import OLD_NAMES, new_names
from plait.errors import ConfigError

__all__ = ["config_to_dict", "config_from_dict", "config_to_json", "config_from_json"]


# `config` is a `plait.config.Config` and `cls` its class (typed Any: plait.config imports this module).


def config_to_dict(config: Any) -> dict[str, Any]:
    """The fields as plain JSON-ready values."""
    d = asdict(replace(config, init_fn=None))
    for name in ("layers_per_stage", "split_points", "leaf_modules", "stage_tp", "stage_dp"):
        if d[name] is not None:
            d[name] = list(d[name])
    for name in ("recompute", "recompute_by_layer"):
        if isinstance(d[name], tuple):
            d[name] = list(d[name])
    if d["tp_plan"] is not None:
        d["tp_plan"] = {str(k): str(v) for k, v in d["tp_plan"]}
    return d


def config_from_dict(cls: Any, data: Any) -> Any:
    """The Config of `to_dict()` output (unknown names are an error; missing ones default)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a Config is a JSON object of its fields, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in known and k not in OLD_NAMES)
    if unknown:
        raise ConfigError(f"unknown Config fields {unknown}; known: {sorted(known)}")
    values = new_names(data)  # a Config saved before the layout's fields took the Plan's names
    for name in ("layers_per_stage", "split_points", "leaf_modules", "recompute", "recompute_by_layer"):
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError) as e:  # a field of the wrong type deep inside a check
        raise ConfigError(f"not a valid Config ({type(e).__name__}: {e}); expected Config.to_dict() output") from None


def config_to_json(config: Any) -> str:
    """The fields as a JSON object."""
    return json.dumps(config_to_dict(config), indent=1)


def config_from_json(cls: Any, text: str | bytes) -> Any:
    """The Config of `to_json()` output; anything else raises ConfigError."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"not a plait Config: not JSON ({type(e).__name__}: {e})") from None
    return config_from_dict(cls, data)
