"""Which placeholders of a graph its operations write in place, directly or through a view.

A stage receives its activations as leaves that require grad (the gradient layer,
runtime/executor.py), and autograd forbids writing a leaf that requires grad in place. In one
process the same value was some operation's output, which may be written: a stage that does
`x.add_(...)`, `x[:, 0] = ...` or `nn.ReLU(inplace=True)` on what it received would fail. The
executor hands such inputs over as a copy (a non-leaf whose gradient flows to the leaf); this
module finds them, from the graph alone::

    recv_x --view--> v --add_--> ...        recv_x is written (through the view v)
    recv_y --mul---> w --add_--> ...        recv_y is not (w is a new tensor)

An aten operation writes the arguments its schema marks `(a!)`; its output aliases its first
argument when the schema says so (`view`, `transpose`, `select`, ...). A torch.fx graph's
Python-level calls are judged by name (methods ending in `_`, `setitem`, `inplace=True`), and
any call whose output may alias its first argument is followed: over-reporting only costs a copy.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["written_placeholders"]

# Python-level (torch.fx) calls whose result may share memory with their first argument.
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "squeeze", "unsqueeze",
    "expand", "expand_as", "narrow", "select", "flatten", "unflatten", "t", "T", "mT", "unbind",
    "split", "chunk", "tensor_split", "movedim", "swapaxes", "diagonal", "as_strided", "detach",
    "contiguous", "__getitem__", "unfold", "real", "imag", "view_as_real", "view_as_complex",
})
_WRITING_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def written_placeholders(graph: fx.Graph, root: nn.Module | None = None) -> set[fx.Node]:
    """The placeholders of `graph` that some operation writes in place, or writes a view of.

    `root` resolves a fx graph's call_module targets (a module with `inplace=True` writes its input).
    """
    written: set[fx.Node] = set()
    for node in graph.nodes:
        for target in _written_args(node, root):
            written |= _sources(target)
    return {n for n in written if n.op == "placeholder"}


def _written_args(node: fx.Node, root: nn.Module | None) -> list[fx.Node]:
    """The argument nodes `node` writes in place."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        out = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                out += _nodes(value)
        return out
    first = node.args[0] if node.args else None
    if node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).endswith("__"):
        return _nodes(first)
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if node.target in _WRITING_OPERATORS or node.kwargs.get("inplace") is True or (
            name.endswith("_") and not name.endswith("__") and isinstance(first, fx.Node)
        ):
            return _nodes(first)
    if node.op == "call_module" and root is not None:
        try:
            module = root.get_submodule(str(node.target))
        except AttributeError:
            return []
        if getattr(module, "inplace", False) is True:
            return _nodes(first)
    return []


def _may_alias_first(node: fx.Node) -> bool:
    """Whether `node`'s output may share memory with its first argument."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS or str(node.target).endswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return name in _VIEW_METHODS or name.endswith("_")
    return False


def _sources(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it may alias, following views back to where the memory was made."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if _may_alias_first(current) and current.args:
            stack += _nodes(current.args[0])
    return seen


def _nodes(value: Any) -> list[fx.Node]:
    """The fx nodes in an argument (a node, or a list/tuple of them)."""
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes(v)]
    return []

