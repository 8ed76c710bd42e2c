"""Running a stage graph tensor-parallel: parameters cut, shapes made local, collectives inserted.

Each parameter is cut to this rank's part, and the collectives of Megatron-LM go where the stage's
`TpLayout` says:

    colwise   x -> copy(x) -> linear(x, W[r]) -> split output   copy: identity; backward all-reduce
    rowwise   split x -> linear(x, W[:, r]) -> reduce -> + b    reduce: all-reduce; backward identity
    vocab     ids -> lookup of the rows this rank holds (others 0) -> reduce
    output    a split value leaving the stage -> gather (all-gather; backward: this rank's part);
              the training pipeline's last stage leaves its logits split for the loss
              (`plait.runtime.tp.vocab_loss`)

(Megatron's f and g operators, Shoeybi et al. 2019, figure 3.) With sequence parallelism
(Korthikanti et al. 2022) a row-parallel sum is reduce-scattered over the tokens instead (its bias
added after), a whole operand spanning the split tokens is cut to this rank's part (its gradient
all-gathered), one broadcast over them (a bias, a layer norm's weight) gets its gradient
all-reduced, and the tokens are all-gathered before an operation that needs them whole (the
collectives: `plait.runtime.tp.tp_collectives`). A view, expand or split of a split value gets its
shape with the split dimension divided by tp; a dropout on a split value draws the whole mask and
keeps this rank's part (attention with dropout, split by heads, runs unfused to do so). Each
parameter is cut in place (`p.data`), once: the module, the user's model and every stage graph
keep holding the same `Parameter`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from plait.capture.graph_nodes import args_of, kwargs_of, linear_parts, shape_of
from plait.capture.shard_rules import Shard, attention_dropout, is_seq, seq_operands
from plait.capture.tp_layout import VIEWS, TpLayout, gathered_for_colwise
from plait.errors import ConfigError
from plait.runtime.tp.tp_collectives import (BroadcastSum, Narrow, SplitAttention, SplitDropout, TpCollective, VocabLookup, Widen,
                                             WideProduct)
from plait.tensor_parts import TpShard, local_part, part_rows, part_size, shard_of, whole_shape

__all__ = ["shard_stage"]

aten = torch.ops.aten
_ELEMENTWISE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)  # broadcast operands


def _cut(param: torch.Tensor, dim: int, blocks: int, tp_rank: int, tp: int) -> None:
    done = shard_of(param)
    if done is not None:
        if (done.dim, done.blocks, done.tp_rank, done.tp) != (dim, blocks, tp_rank, tp):
            raise ConfigError(f"a parameter of shape {done.shape} is cut on dim {done.dim} by one stage graph "
                              f"and on dim {dim} by another; give it one strategy in tp_plan")
        return
    shape = tuple(param.shape)
    with torch.no_grad():
        size = list(shape)
        size[dim] = part_size(shape[dim], tp_rank, tp)
        if param.is_meta:  # another rank's stage: only the shape changes
            param.data = torch.empty(size, dtype=param.dtype, device="meta")
        elif param.numel() and not param.untyped_storage().nbytes():  # no values yet (`plait.materialize.Deferred`):
            param.data = torch.empty(size, dtype=param.dtype, device=param.device)  # its part's shape, filled later
            param.untyped_storage().resize_(0)
        else:
            param.data = local_part(param.data, dim, blocks, tp_rank, tp).clone()
    param.grad = None  # a whole-shaped gradient left by an earlier backward (the planner's profile)
    param._plait_tp = TpShard(shape, dim, blocks, tp_rank, tp)  # type: ignore[attr-defined]


# -- the rewrite ---------------------------------------------------------------------------------

def shard_stage(gm: fx.GraphModule, layout: TpLayout, tp_rank: int, group: Any,
                gather_outputs: bool = True, low_precision: bool = False) -> dict[int, tuple[int, int, int]]:
    """Cut `gm`'s parameters to this rank's parts and rewrite its graph to run on them. Split
    values leaving the graph are gathered, or with `gather_outputs` False (the last stage's, for
    `plait.runtime.tp.vocab_loss`) left split: returns {output index: (dim, blocks, whole size along
    dim)} of those. `low_precision` (the stage computes in bf16 or fp16): a sum the ranks split is
    added in fp32 and rounded once (`Widen`, `Narrow`)."""
    tp = layout.tp
    left: dict[int, tuple[int, int, int]] = {}
    for target, (dim, blocks) in layout.params.items():
        _cut(gm.get_parameter(target), dim, blocks, tp_rank, tp)
    graph = gm.graph
    count = [0]

    def module(mod: nn.Module) -> str:
        name = f"_plait_tp_{count[0]}"
        count[0] += 1
        gm.add_submodule(name, mod)
        return name

    copies: dict[fx.Node, fx.Node] = {}  # a value whose gradient each rank holds a share of: all-reduced
    gathered: dict[fx.Node, fx.Node] = {}  # a token-split value, whole
    scattered: dict[tuple[fx.Node, int], fx.Node] = {}  # a whole value, this rank's tokens
    entries = {value: (rowwise, dim) for rowwise, (value, dim) in layout.seq_entries.items()}
    biases: dict[str, fx.Node | None] = {}  # a row-parallel bias, added after the reduce-scatter

    values: dict[str, Any] = dict(layout.values)  # and the nodes inserted here

    def layout_of(value: Any) -> Any:
        return values.get(value.name) if isinstance(value, fx.Node) else None

    def collective(before: fx.Node, cache: dict[Any, fx.Node], key: Any, value: fx.Node, kind: str,
                   dim: int = -1) -> fx.Node:
        if key not in cache:
            with graph.inserting_before(before):
                cache[key] = graph.call_module(module(TpCollective(kind, group, tp_rank, tp, dim)), (value,))
            values[cache[key].name] = Shard(dim, 1, seq=True) if kind == "scatter" else (
                None if kind.startswith("gather") else layout_of(value))
        return cache[key]

    def copy(before: fx.Node, value: fx.Node) -> fx.Node:
        return collective(before, copies, value, value, "copy")

    widened: dict[Any, fx.Node] = {}  # a value, in fp32 where it is low precision (`Widen`)

    def widen(before: fx.Node, value: fx.Node, key: Any = None) -> fx.Node:
        key = value if key is None else key
        if key not in widened:
            with graph.inserting_before(before):
                widened[key] = graph.call_module(module(Widen()), (value,))
            widened[key].meta.update({k: value.meta[k] for k in ("val",) if k in value.meta})
            values[widened[key].name] = layout_of(value)
        return widened[key]

    def narrow(value: fx.Node, like: fx.Node) -> fx.Node:
        """`value`, a product computed wide, rounded back to `like`'s dtype for its users."""
        users = list(value.users)
        with graph.inserting_after(value):
            out = graph.call_module(module(Narrow()), (value, like))
        _same_meta(out, value)
        values[out.name] = values.get(value.name)
        for user in users:
            user.replace_input_with(value, out)
        return out

    def wide_product(node: fx.Node, x: fx.Node, weight: fx.Node, bias: fx.Node | None, colwise: bool) -> fx.Node:
        """`node`, a product of (widened) `x` and `weight` (+ `bias`), made `WideProduct` (+ the bias in
        fp32); returns the node its users now read."""
        transposed = node.target is aten.linear.default
        with graph.inserting_before(node):
            out = graph.call_module(module(WideProduct(transposed, colwise)), (x, weight))
            if bias is not None:
                out = graph.call_function(aten.add.Tensor, (out, widen(node, bias)))
        _same_meta(out, node)
        values[out.name] = values.get(node.name)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        return out

    def summed(before: fx.Node, value: fx.Node) -> fx.Node:
        """`value`, broadcast over the split tokens, with its gradient summed over the tp ranks: an
        all-reduce (`copy`), or in low precision the sum over tokens and ranks in fp32 (`BroadcastSum`)."""
        if not low_precision or before.target not in _ELEMENTWISE:
            # (a layer norm's weight: its low-precision kernel rounds its sums in blocks of its own,
            # which no split of the tokens reproduces; fp32 weights would change its input gradient)
            return copy(before, value)
        others = tuple(a for a in before.all_input_nodes if a is not value)
        with graph.inserting_before(before):
            out = graph.call_module(module(BroadcastSum(group)), (value, *others))
        return out

    partial: set[fx.Node] = set()  # the column-parallel inputs whose gradient a reduce-scatter sums
    low_weights: dict[str, fx.Node] = {}  # a row-parallel linear's weight: the low dtype its sum rounds to

    for node in list(graph.nodes):
        role = layout.roles.get(node.name)
        here = values.get(node.name)
        if node.name in layout.gathers:  # token-split inputs of an operation that needs them whole
            for value in node.all_input_nodes:
                if is_seq(layout_of(value)):
                    readers = [u for u in value.users if u.name in layout.gathers]
                    for_colwise = gathered_for_colwise(layout, value)
                    kind, key = ("gather_partial" if for_colwise else "gather"), value
                    if for_colwise and low_precision:  # one each reader, in fp32 (see the colwise role)
                        kind, key = "gather_partial_wide", (value, node)
                    whole = collective(node, gathered, key, value, kind, layout_of(value).dim)
                    if for_colwise:
                        partial.add(whole)
                        partial.update(u for u in readers if u.target in VIEWS)
                    node.replace_input_with(value, whole)
        if not role and node.name not in entries:
            needs = seq_operands(node, here, layout_of)
            for value, need, dim in needs:  # (first: a broadcast operand takes the local shapes)
                if need == "scatter":
                    node.replace_input_with(value, collective(node, scattered, (value, dim), value, "scatter", dim))
            for value, need, _ in needs:
                if need == "sum":
                    node.replace_input_with(value, summed(node, value))
        if node.name in entries and entries[node.name][0] != node.name:  # a row-parallel sum's view: scatter it
            rowwise = entries[node.name][0]
            made = _reduce_scatter_after(graph, node, module(TpCollective("reduce_scatter", group, tp_rank, tp,
                                                                          entries[node.name][1])),
                                         biases.pop(rowwise), summed)
            for new in made:
                values[new.name] = here
            if low_precision:
                narrow(made[-1], low_weights[rowwise])
            continue
        if role == "colwise":
            parts = linear_parts(node)
            assert parts is not None
            x = parts.x
            if x not in partial and not low_precision:  # (else the reduce-scatter behind it sums the gradient)
                node.replace_input_with(x, copy(node, x))
            elif x not in partial:
                # its input's gradient is a sum over the ranks: this rank's share and the sum in fp32,
                # rounded once; one each reader, as one process rounds each reader's gradient of x
                narrow(wide_product(node, copy(node, widen(node, x, node)), parts.weight, parts.bias, True), x)
            else:  # gathered in fp32 for this reader: its share reduce-scattered in fp32 (gather_partial_wide)
                narrow(wide_product(node, x, parts.weight, parts.bias, True), parts.weight)
        elif role == "rowwise" and node.name in layout.seq_entries:
            entry, dim = layout.seq_entries[node.name]
            parts = linear_parts(node)
            assert parts is not None
            product, bias = _partial_product(graph, node)
            if low_precision:  # the partial sums, their reduce-scatter and the bias in fp32, rounded once after
                product = wide_product(product, widen(product, parts.x, product), parts.weight, None, False)
                low_weights[node.name] = parts.weight
            if entry == node.name:
                made = _reduce_scatter_after(graph, product, module(TpCollective("reduce_scatter", group, tp_rank,
                                                                                  tp, dim)),
                                             bias, summed)
                for new in made:
                    values[new.name] = here
                if low_precision:
                    narrow(made[-1], parts.weight)
            else:
                biases[node.name] = bias
        elif role == "rowwise":
            parts = linear_parts(node)
            assert parts is not None
            product, last = _rowwise(graph, node, module(TpCollective("reduce", group, tp_rank, tp)))
            if low_precision:  # the partial sums and their sum in fp32, rounded once
                wide_product(product, widen(product, parts.x, product), parts.weight, None, False)
                if parts.bias is not None:
                    last.replace_input_with(parts.bias, widen(last, parts.bias))
                narrow(last, parts.x)
        elif role == "vocab":
            pad = args_of(node)[2] if len(args_of(node)) > 2 else -1
            start = part_rows(whole_shape(gm.get_parameter(str(args_of(node)[0].target)))[0], tp_rank, tp)[0]
            with graph.inserting_before(node):
                new = graph.call_module(module(VocabLookup(group, start, int(pad))), (args_of(node)[0], args_of(node)[1]))
            _same_meta(new, node)  # (its shape: an operand sequence parallelism may cut to its tokens)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        elif node.op == "output":
            if not gather_outputs:
                outputs = args_of(node)[0]
                for i, value in enumerate(outputs if isinstance(outputs, (list, tuple)) else [outputs]):
                    lay = layout_of(value)
                    if isinstance(lay, Shard) and not lay.seq:
                        left[i] = (lay.dim, lay.blocks, _whole(value, lay.dim))

            def gather(value: fx.Node) -> fx.Node:
                lay = values.get(value.name)
                if not isinstance(lay, Shard) or (not gather_outputs and not lay.seq):
                    return value
                with graph.inserting_before(node):
                    return graph.call_module(module(TpCollective("gather", group, tp_rank, tp, lay.dim, lay.blocks,
                                                                 _whole(value, lay.dim))), (value,))
            node.args = fx.map_arg(args_of(node), gather)
        elif node.op == "call_function" and node.name not in layout.gathers:
            _local_shapes(graph, node, here, values, tp, module, tp_rank)
    graph.lint()
    gm.recompile()
    return left


def _same_meta(node: fx.Node, source: fx.Node) -> None:
    """`node`, standing in for `source`, takes its traced value and where it came from."""
    node.meta.update({k: source.meta[k] for k in ("val", "nn_module_stack", "stack_trace") if k in source.meta})


def _partial_product(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """A row-parallel linear without its bias: x W[r], a partial sum (and the bias, to add after)."""
    p = linear_parts(node)
    assert p is not None
    with graph.inserting_after(node):
        target = aten.linear.default if node.target is aten.linear.default else aten.mm.default
        product = graph.call_function(target, (p.x, p.weight))
    _same_meta(product, node)
    node.replace_all_uses_with(product)
    graph.erase_node(node)
    return product, p.bias


def _reduce_scatter_after(graph: fx.Graph, value: fx.Node, reduce_scatter: str, bias: fx.Node | None,
                          copy: Callable[[fx.Node, fx.Node], fx.Node]) -> list[fx.Node]:
    """value (partial sums, whole shape) -> reduce-scatter over its tokens (+ the bias, whose gradient
    each rank then holds for its tokens only: all-reduced by `copy(before, bias)`); returns the
    token-split nodes made."""
    users = list(value.users)
    with graph.inserting_after(value):
        last = scattered = graph.call_module(reduce_scatter, (value,))
    if bias is not None:
        with graph.inserting_after(scattered):
            last = graph.call_function(aten.add.Tensor, (scattered, bias))
        last.replace_input_with(bias, copy(last, bias))
    for user in users:
        user.replace_input_with(value, last)
    return [scattered, last]


def _rowwise(graph: fx.Graph, node: fx.Node, reduce: str) -> tuple[fx.Node, fx.Node]:
    """y = x W (+ b) -> reduce(x W[r]) (+ b): the bias added once, after the sum; (the product, the
    last node)."""
    product, bias = _partial_product(graph, node)
    users = list(product.users)
    with graph.inserting_after(product):
        last = total = graph.call_module(reduce, (product,))
    if bias is not None:
        with graph.inserting_after(total):
            last = graph.call_function(aten.add.Tensor, (total, bias))
    _same_meta(total, product)
    _same_meta(last, product)
    for user in users:
        user.replace_input_with(product, last)
    return product, last


def _local_shapes(graph: fx.Graph, node: fx.Node, here: Any, values: dict[str, Any], tp: int, module: Any,
                  tp_rank: int) -> None:
    """Shapes and splits of split values, made local; dropout on them drawn whole."""
    source = args_of(node)[0] if args_of(node) else None
    before = values.get(source.name) if isinstance(source, fx.Node) else None
    if not isinstance(before, Shard):
        return
    if node.target in VIEWS and isinstance(here, Shard):
        sizes = list(args_of(node)[1])
        if isinstance(sizes[here.dim], int) and sizes[here.dim] != -1:
            sizes[here.dim] = part_size(sizes[here.dim], tp_rank, tp)  # (n // tp where tp divides it)
        node.args = (args_of(node)[0], sizes, *args_of(node)[2:])
    elif node.target is aten.split.Tensor and _along(node, before):
        node.args = (args_of(node)[0], args_of(node)[1] // tp, *args_of(node)[2:])
    elif node.target is aten.split_with_sizes.default and _along(node, before):
        node.args = (args_of(node)[0], [s // tp for s in args_of(node)[1]], *args_of(node)[2:])
    elif node.target is aten.dropout.default:
        drop = module(SplitDropout(before.dim, before.blocks, tp_rank, tp, _whole(node, before.dim)))
        with graph.inserting_before(node):
            new = graph.call_module(drop, tuple(args_of(node)))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    elif node.target is aten.scaled_dot_product_attention.default and attention_dropout(node) != 0.0:
        with graph.inserting_before(node):
            new = graph.call_module(module(SplitAttention(tp_rank, tp)), tuple(args_of(node)), kwargs_of(node))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    elif node.target is aten._assert_tensor_metadata.default:
        graph.erase_node(node)


def _whole(value: fx.Node, dim: int) -> int:
    """The traced size of `value` along `dim` (0 where it is not a known number)."""
    shape = shape_of(value) or ()
    return max(shape[dim], 0) if dim < len(shape) else 0


def _along(node: fx.Node, lay: Shard) -> bool:
    rank = args_of(node)[0].meta["val"].dim()
    d = args_of(node)[2] if len(args_of(node)) > 2 else kwargs_of(node).get("dim", 0)
    return bool(int(d) % rank == lay.dim)
