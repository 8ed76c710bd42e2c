"""How a split along one dimension passes through each operation of a captured graph.

A tensor of a stage graph under tensor parallelism (tp ranks) is either replicated (`None`: every
rank holds all of it) or a `Shard`: rank r holds part r of dimension `dim` (unevenly where tp does
not divide it: a vocabulary, `plait.tensor_parts`). With `blocks` = b > 1
the dimension is b equal blocks (a fused q|k|v projection's output), each split over the ranks, so
a rank's part is its slice of every block, in block order:

    global  [ q0 q1 | k0 k1 | v0 v1 ]        blocks = 3, tp = 2
    rank 0  [ q0 | k0 | v0 ]   rank 1  [ q1 | k1 | v1 ]

`propagate` gives every node its layout from its inputs' (operations in graph order) or raises
`Conflict` naming the node whose operation cannot take a split input (a layer norm over the split
dimension, a slice across it): the column-parallel operations that split that input are then run
replicated instead (`plait.capture.megatron_layout`). Shapes come from the capture's `meta["val"]`
(`plait.capture.graph_nodes`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from plait.capture.graph_nodes import args_of, kwargs_of, reshape_dim, shape_of, shape_of_val

__all__ = ["Shard", "Conflict", "propagate", "SAME_LAYOUT", "is_seq", "seq_operands", "attention_dropout"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Shard:
    """Dimension `dim` split over the tp ranks (in `blocks` equal blocks), started by `sources`;
    `seq`: split along the tokens by sequence parallelism (`plait.capture.megatron_layout`)."""

    dim: int
    blocks: int = 1
    sources: frozenset[str] = field(default=frozenset(), compare=False)
    seq: bool = False


Layout = Any  # Shard | None | tuple[Layout, ...] (an operation with several outputs)


class Conflict(Exception):
    """`node` cannot take the split of its input; `sources` split it."""

    def __init__(self, node: fx.Node, sources: frozenset[str], why: str):
        super().__init__(f"{node.name}: {why}")
        self.node, self.sources, self.why = node, sources, why


# Operations whose output is laid out as their (first) input.
SAME_LAYOUT = {
    aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
    aten.type_as.default, aten.dropout.default, aten.lift_fresh_copy.default,
}
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
              aten.var.correction, aten.std.correction}
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}


def _sources(*layouts: Layout) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for lay in layouts:
        if isinstance(lay, Shard):
            out |= lay.sources
        elif isinstance(lay, tuple):
            out |= _sources(*lay)
    return out


def propagate(nodes: Sequence[fx.Node], start: Callable[[fx.Node, Callable[[Any], Layout]], Layout | bool],
              tp: int, gathered: frozenset[fx.Node] = frozenset()) -> dict[fx.Node, Layout]:
    """Every node's layout, in order. `start(node, layout_of)` decides the linear and embedding
    operations (their layout, or False to use the rules here); raises Conflict. The nodes in
    `gathered` read their sequence-split inputs whole (gathered before them)."""
    layouts: dict[fx.Node, Layout] = {}

    def layout_of(value: Any) -> Layout:
        return layouts.get(value) if isinstance(value, fx.Node) else None

    def whole_seq(value: Any) -> Layout:
        lay = layout_of(value)
        return None if is_seq(lay) else lay

    for node in nodes:
        look = whole_seq if node in gathered else layout_of
        given = start(node, look)
        layouts[node] = _rule(node, look, tp) if given is False else given
    return layouts


def is_seq(lay: Layout) -> bool:
    """A value split along its tokens (sequence parallelism)."""
    return isinstance(lay, Shard) and lay.seq


def _rule(node: fx.Node, layout_of: Callable[[Any], Layout], tp: int) -> Layout:
    inputs = [layout_of(a) for a in node.all_input_nodes]
    split = [lay for lay in inputs if lay is not None]
    if node.op == "output" or not split:
        return None
    if node.op != "call_function":
        raise Conflict(node, _sources(*split), f"{node.op} {node.target} takes a split input")
    target = node.target
    head = args_of(node)[0] if args_of(node) else None
    first = layout_of(head[0] if isinstance(head, (list, tuple)) and head else head)
    if target is operator.getitem:
        whole = layout_of(args_of(node)[0])
        return whole[args_of(node)[1]] if isinstance(whole, tuple) else whole
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _pointwise(node, layout_of)
    if target in SAME_LAYOUT:
        return first
    if target is aten._assert_tensor_metadata.default:
        return None
    rule = _RULES.get(target)
    if rule is None or not isinstance(first, Shard):
        raise Conflict(node, _sources(*split), f"{target} is not known to take a split input")
    if target in _ALL_ALIKE:  # every tensor operand split the same way (q, k, v; both factors)
        operands = [layout_of(a) for a in _ALL_ALIKE[target](node)]
        if any(lay != first for lay in operands):
            raise Conflict(node, _sources(*split), f"{target} takes operands split differently")
    return rule(node, first, tp)


def _fail(node: fx.Node, lay: Shard, why: str) -> Conflict:
    return Conflict(node, lay.sources, why)


def _pointwise(node: fx.Node, layout_of: Callable[[Any], Layout]) -> Layout:
    """Element-wise: every split operand split along the same output dimension; a whole operand
    broadcast along it (size 1 there, or without that dimension)."""
    out = shape_of(node)
    if out is None:
        raise Conflict(node, _sources(*[layout_of(a) for a in node.all_input_nodes]), "no traced shape")
    found: Shard | None = None
    unknown = [a for a in node.all_input_nodes if a.meta.get("val") is None and a.op != "get_attr"]
    tensors = [a for a in node.all_input_nodes if shape_of(a) is not None]
    for a in tensors:
        lay = layout_of(a)
        if isinstance(lay, Shard):
            d = lay.dim + len(out) - len(shape_of(a) or ())
            if found is not None and (found.dim, found.blocks) != (d, lay.blocks):
                raise _fail(node, lay, "operands split along different dimensions")
            if found is not None and found.seq != lay.seq:
                raise _fail(node, lay, "operands split along the tokens and along the features")
            found = Shard(d, lay.blocks, lay.sources | (found.sources if found else frozenset()), lay.seq)
    assert found is not None
    if unknown:
        raise _fail(node, found, f"operand {unknown[0].name} has no traced shape")
    for a in tensors:
        shape = shape_of(a) or ()
        offset = len(out) - len(shape)
        if layout_of(a) is None and found.dim >= offset and shape[found.dim - offset] != 1 and not found.seq:
            raise _fail(node, found, f"whole operand {a.name} meets a split one along dim {found.dim}")
    return found  # a whole operand along split tokens: each rank takes its tokens' part (`seq_operands`)


def seq_operands(node: fx.Node, lay: Layout, layout_of: Callable[[Any], Layout]) -> list[tuple[fx.Node, str, int]]:
    """The whole tensor operands of an operation on tokens split by sequence parallelism (`lay`,
    its output's layout), and what each needs: "scatter" (it spans the split tokens: each rank
    takes its part; the gradient all-gathered back) or "sum" (broadcast over them, e.g. a bias or
    a layer norm's weight: each rank's gradient covers its tokens only, all-reduced), with the
    operand's dimension along the tokens (-1 for "sum")."""
    first = lay[0] if isinstance(lay, tuple) else lay
    if not is_seq(first) or node.op != "call_function":
        return []
    out = shape_of(node) or shape_of_val(node.meta["val"][0])
    found = []
    for a in node.all_input_nodes:
        shape = shape_of(a)
        if shape is None or layout_of(a) is not None:
            continue
        offset = len(out) - len(shape)
        spans = first.dim >= offset and shape[first.dim - offset] != 1
        found.append((a, "scatter", first.dim - offset) if spans else (a, "sum", -1))
    return found


def _reshape(node: fx.Node, lay: Shard, tp: int) -> Layout:
    before, after = shape_of(args_of(node)[0]), shape_of(node)
    if before is None or after is None:
        raise _fail(node, lay, "no traced shape")
    e = reshape_dim(before, after, lay.dim, tp, lay.blocks)
    uneven = before[lay.dim] % tp != 0  # a vocabulary cut unevenly: its parts merge or cut with nothing
    if e is None or ((lay.blocks > 1 or uneven) and after[e] != before[lay.dim]):
        raise _fail(node, lay, f"a view from {list(before)} to {list(after)} moves split dim {lay.dim}")
    sizes = args_of(node)[1]
    if e < len(sizes) and isinstance(sizes[e], fx.Node):
        raise _fail(node, lay, "split dimension has a symbolic size")
    return replace(lay, dim=e)


def _transpose(node: fx.Node, lay: Shard, tp: int) -> Layout:
    rank = len(shape_of(node) or ())
    a, b = (d % rank for d in args_of(node)[1:3]) if node.target is aten.transpose.int else (0, 1)
    return replace(lay, dim=b if lay.dim == a else a if lay.dim == b else lay.dim)


def _permute(node: fx.Node, lay: Shard, tp: int) -> Layout:
    rank = len(args_of(node)[1])
    order = [d % rank for d in args_of(node)[1]]
    return replace(lay, dim=order.index(lay.dim))


def _unsqueeze(node: fx.Node, lay: Shard, tp: int) -> Layout:
    d = args_of(node)[1] % len(shape_of(node) or (0,))
    return replace(lay, dim=lay.dim + 1 if d <= lay.dim else lay.dim)


def _squeeze(node: fx.Node, lay: Shard, tp: int) -> Layout:
    rank = len(shape_of(args_of(node)[0]) or ())
    d = args_of(node)[1] % rank if len(args_of(node)) > 1 and isinstance(args_of(node)[1], int) else None
    if d is None or d == lay.dim:
        raise _fail(node, lay, "squeeze of the split dimension")
    return replace(lay, dim=lay.dim - 1 if d < lay.dim else lay.dim)


def _dim_arg(node: fx.Node, index: int, default: int) -> int:
    value = args_of(node)[index] if len(args_of(node)) > index else kwargs_of(node).get("dim", default)
    return int(value) % len(shape_of(args_of(node)[0]) or (0,))


def _split(node: fx.Node, lay: Shard, tp: int) -> Layout:
    """split / split_with_sizes / chunk: along another dimension each piece keeps the split; along
    the split one, equal pieces one per block (q|k|v)."""
    d = _dim_arg(node, 2, 0)
    count = len(node.meta.get("val", ()))
    if d != lay.dim:
        return tuple(lay for _ in range(count))
    sizes = {shape_of_val(v)[d] for v in node.meta.get("val", ())}
    if lay.blocks != count or len(sizes) != 1 or (shape_of(args_of(node)[0]) or (0,) * (d + 1))[d] % tp:
        raise _fail(node, lay, f"{count} pieces of a dim split in {lay.blocks} blocks")
    return tuple(Shard(d, 1, lay.sources) for _ in range(count))


def _other_dim(index: int) -> Callable[[fx.Node, Shard, int], Layout]:
    """slice, select, cat, softmax: fine along any other dimension than the split one."""
    def rule(node: fx.Node, lay: Shard, tp: int) -> Layout:
        d = _dim_arg(node, index, 0)
        if d == lay.dim:
            raise _fail(node, lay, f"{node.target} along the split dimension {d}")
        if node.target is aten.select.int:
            return replace(lay, dim=lay.dim - 1 if d < lay.dim else lay.dim)
        return lay
    return rule


def _cat(node: fx.Node, lay: Shard, tp: int) -> Layout:
    parts = args_of(node)[0]
    d = int(args_of(node)[1]) if len(args_of(node)) > 1 else 0
    d %= len(shape_of(node) or (0,))
    if d == lay.dim or any(not isinstance(p, fx.Node) for p in parts):
        raise _fail(node, lay, "cat along the split dimension")
    return lay


def _reduce(node: fx.Node, lay: Shard, tp: int) -> Layout:
    rank = len(shape_of(args_of(node)[0]) or ())
    dims = args_of(node)[1] if len(args_of(node)) > 1 else None
    dims = [dims] if isinstance(dims, int) else list(dims or range(rank))
    dims = [d % rank for d in dims]
    if lay.dim in dims:
        raise _fail(node, lay, "reduction over the split dimension")
    keep = bool(args_of(node)[2]) if len(args_of(node)) > 2 else bool(kwargs_of(node).get("keepdim", False))
    return lay if keep else replace(lay, dim=lay.dim - sum(d < lay.dim for d in dims))


def _expand(node: fx.Node, lay: Shard, tp: int) -> Layout:
    out = shape_of(node) or ()
    before = shape_of(args_of(node)[0]) or ()
    d = lay.dim + len(out) - len(before)
    if isinstance(args_of(node)[1][d], fx.Node):
        raise _fail(node, lay, "split dimension has a symbolic size")
    return replace(lay, dim=d)


def _attention(node: fx.Node, lay: Shard, tp: int) -> Layout:
    """scaled_dot_product_attention: q, k, v split by heads (dim 1), the mask broadcast over them
    (with dropout, each rank keeps its heads of the whole mask: `plait.runtime.tp.tensor_parallel`)."""
    mask = args_of(node)[3] if len(args_of(node)) > 3 else kwargs_of(node).get("attn_mask")
    if lay.dim != 1 or lay.blocks != 1:
        raise _fail(node, lay, "attention split on another dimension than the heads")
    shape = shape_of(mask) if isinstance(mask, fx.Node) else None
    if shape is not None and len(shape) == 4 and shape[1] != 1:
        raise _fail(node, lay, "an attention mask per head")
    if not isinstance(attention_dropout(node), (int, float)):  # (a split one runs unfused: `SplitAttention`)
        raise _fail(node, lay, f"attention dropout {attention_dropout(node)} is a traced value, not a number")
    return lay


def attention_dropout(node: fx.Node) -> Any:
    """scaled_dot_product_attention's dropout probability (0.0 when not given)."""
    return args_of(node)[4] if len(args_of(node)) > 4 else kwargs_of(node).get("dropout_p", 0.0)


def _layer_norm(node: fx.Node, lay: Shard, tp: int) -> Layout:
    """native_layer_norm over the last dims: fine along another one (the tokens); its outputs
    (normalised, mean, 1/std) split alike."""
    rank = len(shape_of(args_of(node)[0]) or ())
    if lay.dim >= rank - len(args_of(node)[1]):
        raise _fail(node, lay, "layer norm over the split dimension")
    return (lay, lay, lay) if node.target is aten.native_layer_norm.default else lay


def _size(node: fx.Node, lay: Shard, tp: int) -> Layout:
    if _dim_arg(node, 1, 0) == lay.dim:
        raise _fail(node, lay, "the size of the split dimension is read")
    return None


def _bmm(node: fx.Node, lay: Shard, tp: int) -> Layout:
    """matmul / bmm of two tensors split along the same batch dimension (heads)."""
    out = shape_of(node) or ()
    if lay.dim >= len(out) - 2:
        raise _fail(node, lay, "matrix product over a split matrix dimension")
    return lay


_ALL_ALIKE: dict[Any, Callable[[fx.Node], list[Any]]] = {
    aten.scaled_dot_product_attention.default: lambda n: list(args_of(n)[:3]),
    aten.matmul.default: lambda n: list(args_of(n)[:2]), aten.bmm.default: lambda n: list(args_of(n)[:2]),
    aten.cat.default: lambda n: list(args_of(n)[0]),
}

_RULES: dict[Any, Callable[[fx.Node, Shard, int], Layout]] = {
    aten.view.default: _reshape, aten.reshape.default: _reshape, aten._unsafe_view.default: _reshape,
    aten.transpose.int: _transpose, aten.t.default: _transpose, aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze,
    aten.split.Tensor: _split, aten.split_with_sizes.default: _split, aten.chunk.default: _split,
    aten.slice.Tensor: _other_dim(1), aten.select.int: _other_dim(1), aten.cat.default: _cat,
    aten.softmax.int: _other_dim(1), aten._softmax.default: _other_dim(1),
    aten.log_softmax.int: _other_dim(1), aten._log_softmax.default: _other_dim(1),
    aten.expand.default: _expand, aten.scaled_dot_product_attention.default: _attention,
    aten.matmul.default: _bmm, aten.bmm.default: _bmm,
    aten.sym_size.int: _size, aten.native_layer_norm.default: _layer_norm,
    aten.layer_norm.default: _layer_norm,
    **{r: _reduce for r in REDUCTIONS},
}
