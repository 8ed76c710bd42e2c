"""The two tracers that capture a model, torch.export and torch.fx: each gives a `Traced` graph of it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from plait.capture.opaque import kept_whole
from plait.capture.output import OutputSpec, flatten_output, unflatten_output
from plait.errors import CaptureError

__all__ = ["Traced", "trace_export", "trace_fx"]


@dataclass(frozen=True)
class Traced:
    """One tracer's graph of the model, before `plait.capture.trace` groups its operations into layers."""

    method: str  # "torch.export" or "torch.fx"
    graph: fx.Graph
    root: nn.Module  # what get_attr / call_module targets resolve against
    leaf_of: Callable[[fx.Node], tuple[str, Hashable] | None]  # an operation's (leaf module, which call)
    bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]  # (args, kwargs) -> each placeholder's value
    finish: Callable[[Any], Any]  # the graph's output value -> what net(...) returns
    kept_whole: tuple[str, ...]  # modules traced as one opaque call each
    output_spec: OutputSpec | None = None


# -- torch.export front end ---------------------------------------------------------------------


_OUT_SPECS: dict[int, OutputSpec] = {}


class _FlatCall(nn.Module):
    """Calls the user's net on flat tensor inputs and returns flat output leaves."""

    def __init__(self, net: nn.Module, in_spec: Any, consts: list[Any], tensor_pos: list[int]):
        super().__init__()
        self.net = net
        self._in_spec = in_spec
        self._consts = consts
        self._tensor_pos = tensor_pos
        # export traces a copy of this module; the spec goes to a table keyed by our id.
        self._key = id(self)

    def forward(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        leaves = list(self._consts)
        for pos, t in zip(self._tensor_pos, tensors):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._in_spec)
        flat, spec = flatten_output(self.net(*args, **kwargs))
        _OUT_SPECS[self._key] = spec
        return tuple(flat)


def trace_export(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], kept: list[str]) -> Traced:
    """torch.export(strict=False) of `net` on one call, the modules `kept` as opaque calls."""
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    consts = [None if i in tensor_pos else x for i, x in enumerate(leaves)]
    wrapper = _FlatCall(net, in_spec, consts, tensor_pos)
    tensors = tuple(leaves[i] for i in tensor_pos)
    # The batch dimension stays symbolic so micro-batches of any size run on one graph.
    dynamic = tuple({0: torch.export.Dim.AUTO} if t.dim() > 0 else {} for t in tensors)
    with kept_whole(net, kept, args, kwargs):
        ep = torch.export.export(wrapper, tensors, dynamic_shapes=(dynamic,), strict=False)
    out_spec = _OUT_SPECS.pop(wrapper._key)
    root = ep.module()
    graph = root.graph
    for node in list(graph.nodes):  # export's shape guards: plait checks shapes at the wire
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            graph.erase_node(node)

    def leaf_of(node: fx.Node) -> tuple[str, Hashable] | None:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return None
        for key, (outer, _) in stack.items():  # a kept module is a leaf, whatever it holds
            if outer.removeprefix("net").removeprefix(".") in kept and outer.startswith("net"):
                return outer.removeprefix("net").removeprefix("."), key
        call, (fqn, _) = list(stack.items())[-1]  # the key names the call: "...block@1" is the 2nd
        if not fqn.startswith("net"):
            return None
        try:
            module = wrapper.get_submodule(fqn)
        except AttributeError:
            return None
        if any(True for _ in module.children()):
            return None
        return fqn.removeprefix("net").removeprefix(".") or "<net>", call

    def bind(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> list[Any]:
        flat, spec = pytree.tree_flatten((call_args, call_kwargs))
        if spec != in_spec:
            raise CaptureError(
                f"the model was captured with inputs shaped like {in_spec} but is now called "
                f"with {spec}; call it with the same structure of tensors every time"
            )
        return [flat[i] for i in tensor_pos]

    return Traced("torch.export", graph, root, leaf_of, bind, lambda out: unflatten_output(list(out), out_spec),
                  tuple(kept), out_spec)


# -- torch.fx front end -------------------------------------------------------------------------


class _LeafTracer(fx.Tracer):
    """Keeps every module without children, and every kept module, as one call_module node: one
    layer per call."""

    def __init__(self, kept: Sequence[str] = ()) -> None:
        super().__init__()
        self.kept = set(kept)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.kept or not any(True for _ in m.children())


def trace_fx(net: nn.Module, kept: Sequence[str] = ()) -> Traced:
    """torch.fx.symbolic_trace of `net`, every module without children and every one `kept` a leaf."""
    graph = _LeafTracer(kept).trace(net)
    signature = inspect.signature(net.forward)
    names = [n.target for n in graph.nodes if n.op == "placeholder"]

    def leaf_of(node: fx.Node) -> tuple[str, Hashable] | None:
        return (str(node.target), node.name) if node.op == "call_module" else None  # a node: a call

    def bind(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> list[Any]:
        bound = signature.bind(*call_args, **call_kwargs)
        bound.apply_defaults()
        return [bound.arguments[str(name).lstrip("*")] for name in names]

    return Traced("torch.fx", graph, net, leaf_of, bind, lambda out: out, tuple(kept))
