"""Flattening a model's output (tensor, tuple, dict, dataclass) into leaves and building it back."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["OutputSpec", "flatten_output", "unflatten_output"]

# A spec is a small tree of tuples:
#   ("leaf",)                          a tensor or symbolic size, carried by the graph
#   ("const", value)                   None, bool, str, plain number: kept out of the graph
#   ("seq", type, (child, ...))        tuple / list (namedtuples too)
#   ("map", type, (key, ...), (child, ...))        dict and Mapping outputs
#   ("dataclass", type, (name, ...), (child, ...)) dataclass outputs (e.g. an object with .logits)
OutputSpec = tuple[Any, ...]


def flatten_output(obj: Any) -> tuple[list[Any], OutputSpec]:
    """Split `obj` into graph leaves and the spec that rebuilds it."""
    leaves: list[Any] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list[Any]) -> OutputSpec:
    if isinstance(obj, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        leaves.append(obj)
        return ("leaf",)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return ("const", obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        children = tuple(_flatten(getattr(obj, n), leaves) for n in names)
        return ("dataclass", type(obj), names, children)
    if isinstance(obj, Mapping):
        keys = tuple(obj.keys())
        return ("map", type(obj), keys, tuple(_flatten(obj[k], leaves) for k in keys))
    if isinstance(obj, (tuple, list)):
        return ("seq", type(obj), tuple(_flatten(x, leaves) for x in obj))
    cache = " (a Hugging Face key/value cache: build the model with config.use_cache=False for training)" \
        if type(obj).__name__.endswith("Cache") else ""
    raise TypeError(
        f"plait cannot carry a model output of type {type(obj).__name__}{cache}; return tensors, "
        "tuples, lists, dicts or dataclasses of them"
    )


def unflatten_output(leaves: list[Any], spec: OutputSpec) -> Any:
    """Inverse of `flatten_output`."""
    it = iter(leaves)
    return _build(spec, it)


def _build(spec: OutputSpec, it: Any) -> Any:
    kind = spec[0]
    if kind == "leaf":
        return next(it)
    if kind == "const":
        return spec[1]
    if kind == "seq":
        items = [_build(c, it) for c in spec[2]]
        cls = spec[1]
        if cls in (tuple, list):
            return cls(items)
        if hasattr(cls, "_fields"):  # namedtuple
            return cls(*items)
        return cls(items)
    if kind == "map":
        values = {k: _build(c, it) for k, c in zip(spec[2], spec[3])}
        return values if spec[1] is dict else spec[1](values)
    if kind == "dataclass":
        values = {n: _build(c, it) for n, c in zip(spec[2], spec[3])}
        return spec[1](**values)
    raise AssertionError(f"unknown output spec kind {kind!r}")
