"""What a node of a captured graph holds: its arguments, its traced shape, the parts of a linear on a parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

__all__ = ["args_of", "kwargs_of", "LinearParts", "linear_parts", "shape_of", "shape_of_val", "reshape_dim"]

aten = torch.ops.aten


@dataclass(frozen=True)
class LinearParts:
    """A matrix product with a parameter: y = x W^T (+ b) (nn.Linear) or x W (+ b) (Conv1D, mm)."""

    x: fx.Node
    weight: fx.Node  # a get_attr node
    bias: fx.Node | None
    out_dim: int  # the weight's output-feature dimension
    in_dim: int


def args_of(node: fx.Node) -> tuple[Any, ...]:
    """A node's positional arguments (fx types them as a union of every argument kind)."""
    return tuple(node.args)


def kwargs_of(node: fx.Node) -> dict[str, Any]:
    return dict(node.kwargs)


def linear_parts(node: fx.Node) -> LinearParts | None:
    """The parts of a linear operation on a parameter, or None."""
    if node.op != "call_function":
        return None
    args = args_of(node)
    if node.target is aten.linear.default and _param(args[1]):
        bias = args[2] if len(args) > 2 and isinstance(args[2], fx.Node) else None
        return LinearParts(args[0], args[1], bias, 0, 1)
    if node.target is aten.addmm.default and _param(args[2]) and _param(args[0]) and not kwargs_of(node):
        return LinearParts(args[1], args[2], args[0], 1, 0)
    if node.target is aten.mm.default and _param(args[1]):
        return LinearParts(args[0], args[1], None, 1, 0)
    return None


def _param(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.op == "get_attr"


def shape_of(node: Any) -> tuple[int, ...] | None:
    """The traced shape of a node's tensor value (a symbolic size by its sample value)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(_hint(s) for s in val.shape)


def _hint(size: Any) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else -2  # unknown: matches nothing


def reshape_dim(before: Sequence[int], after: Sequence[int], dim: int, parts: int, blocks: int) -> int | None:
    """Where split dimension `dim` of `before` lands in `after` (a view of the same elements), or
    None when the split is not a split of one dimension there.

    The dimension keeps its place when the sizes before it multiply to the same product, and it
    may be merged with the dimensions after it (heads x head_dim -> features) or split into
    several, as long as the split stays on the outermost one: [T, 768] -> [T, 12, 64] at tp=2 puts
    heads 0-5 on rank 0."""
    prefix = math.prod(before[:dim])
    n = before[dim]
    acc = 1
    for e, size in enumerate(after):
        if acc == prefix and size != 1:
            if size == n or (size > n and size % n == 0):
                return e
            if size < n and n % size == 0 and size % parts == 0 and blocks == 1:
                return e
            return None
        acc *= size
        if acc > prefix and prefix > 0:
            return None
    return None


def shape_of_val(val: Any) -> tuple[int, ...]:
    return tuple(_hint(s) for s in val.shape)
