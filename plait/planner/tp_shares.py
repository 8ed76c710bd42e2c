"""What tensor parallelism splits in each captured layer, for the cost model (`TpShares`).

The runtime's own layout (`plait.capture.megatron_layout`) is found on the whole model as one stage
graph, and each of its operations is charged to the layer it belongs to:

    a parameter it splits                   -> split_bytes of the parameter's layer
    an op whose output is split             -> its output elements count as split work
    a row-parallel linear, a vocab lookup   -> an all-reduce of its output in the forward
    a column-parallel linear's input        -> an all-reduce of that input's gradient in the backward
    a split value leaving the model         -> an all-gather (the logits); where the loss runs on
                                               them split (`plait.runtime.tp.vocab_loss`: given the loss
                                               and a target), its all-reduces of per-token figures

Bytes are per row of a micro-batch (the traced batch size taken as one row). A model captured in
a low dtype (bf16, fp16: `Config(precision=...)`) sums its split products in fp32, one all-reduce
for each reader of a column-parallel input (`plait.runtime.tp.tensor_parallel`): priced so.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from plait.capture.compute_dtype import LOW_DTYPES
from plait.capture.graph_nodes import linear_parts
from plait.capture.megatron_layout import tp_layouts
from plait.capture.shard_rules import Shard
from plait.capture.split import split
from plait.capture.trace import CapturedGraph
from plait.cost.tp_costs import TpShares
from plait.errors import ConfigError
from plait.runtime.tp.vocab_loss import collectives_of, split_plan

__all__ = ["tp_shares"]


def tp_shares(captured: CapturedGraph, tp: int, tp_plan: Mapping[str, str] | None = None,
              loss: Callable[[Any, Any], torch.Tensor] | None = None, target: Any = None) -> TpShares:
    """Each layer's split bytes, split share and collectives at `tp` (see the module); `loss` and
    `target` (the training loss and a batch's targets): whether the logits leave gathered."""
    n = len(captured.layers.layer_names)
    [stage] = split(captured, [0] * n)
    gm = stage.module
    [layout] = tp_layouts([gm], tp, tp_plan)
    layer_of = {op.name: captured.layers.op_layer[i] for i, op in enumerate(captured.ops)}
    split_bytes, split_work, all_work = [0.0] * n, [0.0] * n, [0.0] * n
    fwd, bwd, gather, fwd_count, bwd_count = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    users_of_param = {node.target: node for node in gm.graph.nodes if node.op == "get_attr"}
    for name in layout.params:
        node = users_of_param.get(name)
        layer = _layer_of_param(node, layer_of)
        if layer is not None:
            p = gm.get_parameter(name)
            split_bytes[layer] += p.numel() * p.element_size()
    reduced_inputs: set[fx.Node] = set()
    for node in gm.graph.nodes:
        layer = layer_of.get(node.name)
        if node.op == "output":
            leaves = _leaves(node.args)
            left = {i: v for i, v in enumerate(leaves) if isinstance(layout.values.get(v.name), Shard)}
            kept = {i: v for i, v in left.items() if not layout.values[v.name].seq}  # as the runtime keeps them
            on_parts = _loss_collectives(captured, leaves, kept, layout, tp, loss, target)
            for i, value in left.items():
                last = layer_of.get(value.name, n - 1)
                if on_parts is None or i not in kept:
                    gather[last] += _row_bytes(value)
                    fwd_count[last] += 1
                    continue
                per_token = _row_bytes(value) / int(value.meta["val"].shape[layout.values[value.name].dim])
                fwd[last] += on_parts[0] * per_token
                bwd[last] += on_parts[1] * per_token
                fwd_count[last] += on_parts[0]
                bwd_count[last] += on_parts[1]
            continue
        if layer is None or node.op != "call_function":
            continue
        size = _row_numel(node)
        all_work[layer] += size
        if isinstance(layout.values.get(node.name), Shard):
            split_work[layer] += size
        role = layout.roles.get(node.name)
        if role in ("rowwise", "vocab"):
            fwd[layer] += _row_bytes(node, wide=role == "rowwise")
            fwd_count[layer] += 1
            split_work[layer] += size
        elif role == "colwise":
            parts = linear_parts(node)
            if parts is not None and (parts.x not in reduced_inputs or _low(parts.x)):
                reduced_inputs.add(parts.x)
                bwd[layer] += _row_bytes(parts.x, wide=True)
                bwd_count[layer] += 1
    share = [s / w if w > 0 else 0.0 for s, w in zip(split_work, all_work)]
    return TpShares(tp, tuple(split_bytes), tuple(min(1.0, x) for x in share), tuple(fwd), tuple(bwd),
                    tuple(gather), tuple(fwd_count), tuple(bwd_count), tuple(layout.describe()))


def _loss_collectives(captured: CapturedGraph, leaves: list[fx.Node], left: dict[int, fx.Node], layout: Any,
                      tp: int, loss: Callable[[Any, Any], torch.Tensor] | None, target: Any) -> tuple[int, int] | None:
    """(forward, backward) all-reduces of the loss run on the split outputs `left` ({leaf: node}),
    as the runtime would run it; None where it gathers them (no loss or target given, or one that
    does not split)."""
    if loss is None or not isinstance(target, torch.Tensor) or not left:
        return None
    rows = int(target.shape[0]) if target.dim() else 1
    whole: dict[int, torch.Tensor] = {}
    split: dict[int, tuple[int, int]] = {}
    for i, value in enumerate(leaves):
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        shape = [s if isinstance(s, int) else rows for s in val.shape]  # the batch's symbolic size
        whole[i] = torch.empty(shape, dtype=val.dtype, device="meta")
        if i in left:
            lay = layout.values[value.name]
            split[i] = (lay.dim, lay.blocks)
    if set(left) - set(split):
        return None
    metas: list[Any] = [whole.get(i) for i in range(len(leaves))]
    plan = split_plan(loss, captured.finish, metas, whole, split, tp, target)
    return None if plan is None else collectives_of(plan[1])


def _layer_of_param(node: fx.Node | None, layer_of: Mapping[str, int]) -> int | None:
    """The layer of a parameter: that of its first user op."""
    if node is None:
        return None
    for user in node.users:
        if user.name in layer_of:
            return layer_of[user.name]
    return None


def _leaves(args: Any) -> list[fx.Node]:
    out: list[fx.Node] = []

    def keep(v: fx.Node) -> fx.Node:
        out.append(v)
        return v

    fx.node.map_arg(args, keep)
    return out


def _row_numel(node: fx.Node) -> float:
    """Elements of a node's tensor value per row: a symbolic (batch) size counts as 1."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    total = 1.0
    for size in val.shape:
        if isinstance(size, int):
            total *= size
        else:
            expr = size.node.expr
            try:
                total *= float(expr.subs({sym: 1 for sym in expr.free_symbols}))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"cannot price tp for {node.name}: its size {size} is not a number per row") from e
    return total if math.isfinite(total) else 0.0


def _low(node: fx.Node) -> bool:
    """A value in a low dtype: the sums the ranks split over it run in fp32."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in LOW_DTYPES


def _row_bytes(node: fx.Node, wide: bool = False) -> float:
    """A row's bytes of `node`'s value (`wide`: a split sum over it, in fp32 where it is low precision)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    return _row_numel(node) * (4 if wide and _low(node) else val.element_size())
