"""`KEY=VALUE,...` options of the command line (`--gpt`, `--layout`), read into a dict."""

from __future__ import annotations

from typing import Sequence

from plait.errors import ConfigError

__all__ = ["key_values", "integer"]


def key_values(text: str, flag: str, keys: Sequence[str], form: str) -> dict[str, str]:
    """`a=1,b=x` -> {"a": "1", "b": "x"}; an item that is not KEY=VALUE with a known KEY is an
    error naming it, the option (`flag`) and the accepted `form`."""
    given: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in keys:
            raise ConfigError(f"cannot read {item!r} in {flag} {text!r}; write {form}")
        given[key.strip()] = value.strip()
    return given


def integer(flag: str, key: str, value: str) -> int:
    """`value` of `key` as an integer, or an error naming both and the option."""
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} {key}={value!r} is not an integer") from None
