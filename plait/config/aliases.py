"""Config's old field names (`layers_per_proc`, `tp_per_stage`, `dp_per_stage`), still taken for the Plan's names."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, TypeVar

from plait.errors import ConfigError

__all__ = ["OLD_NAMES", "new_names", "taking_old_names"]

# old name -> the one name (the Plan's, the plan file's and the Config's)
OLD_NAMES = {"layers_per_proc": "layers_per_stage", "tp_per_stage": "stage_tp", "dp_per_stage": "stage_dp"}

T = TypeVar("T")


def _shown(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


def new_names(values: Mapping[str, Any], where: str = "Config") -> dict[str, Any]:
    """`values` with each old name moved to its new one. Both given: the old one is dropped where
    the new one is None (not given; `dataclasses.replace` passes every field by its new name) or
    equal, else ConfigError naming both."""
    out = {k: v for k, v in values.items() if k not in OLD_NAMES}
    for old, new in OLD_NAMES.items():
        if old not in values:
            continue
        given = out.get(new)
        if given is not None and values[old] is not None and _shown(given) != _shown(values[old]):
            raise ConfigError(f"{where}: {old}={_shown(values[old])!r} and {new}={_shown(given)!r} name one field "
                              f"({old} is {new}'s old name) with different values; give {new} alone")
        if given is None:
            out[new] = values[old]
    return out


def taking_old_names(cls: type[T]) -> type[T]:
    """Wrap the dataclass's generated __init__ so that the old names set the new fields."""
    init: Callable[..., None] = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **(new_names(kwargs) if OLD_NAMES.keys() & kwargs.keys() else kwargs))

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls
