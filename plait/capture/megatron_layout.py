"""Which operations of the stage graphs run tensor-parallel, and how every value is split.

Megatron-LM's 1-D layout (Shoeybi et al. 2019, section 3), found on the captured graph with nothing
changed in the model:

    x (whole) -> [colwise linear: W split by output features] -> split activations
              -> element-wise ops, views, attention by heads (still split)
              -> [rowwise linear: W split by input features] -> partial sums -> all-reduce -> whole

Every linear whose output features divide by tp starts out column-parallel; `propagate` carries the
split forward; a linear meeting a split input on its contraction dimension becomes row-parallel
and its output whole again. An operation that cannot take the split (a layer norm over it, a
residual add with a whole tensor) makes the linears whose split reached it run replicated, and the
propagation is run again until nothing conflicts. What is left split at a stage's output (the
LM head's logits) is gathered there. The word embedding is split by vocabulary rows (a masked
lookup and an all-reduce). A vocabulary that does not divide by tp (GPT-2's 50257 words at tp=2)
is cut unevenly, the last rank holding fewer rows (`plait.tensor_parts`), and so are the LM head
and the logits over it: only a linear whose output features are the word embedding's rows is
split so (an odd width elsewhere stays whole), and a view may not merge or cut such a dimension.

With `sequence_parallel` (Megatron's, Korthikanti et al. 2022) a row-parallel sum is not made
whole but split along its tokens (dim -2 of its (batch, sequence, features) value), so the layer
norms, dropouts and residual adds between the blocks run on each rank's tokens; an operation that
needs all of them (a linear, a view merging the tokens) gets them gathered first (`gathers`).

`Config(tp_plan={pattern: strategy})` fixes the strategy of the modules it names ("colwise",
"rowwise", "vocab", "replicate"); a tied parameter held by several stages gets one placement.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from plait.capture.graph_nodes import LinearParts, args_of, kwargs_of, linear_parts, reshape_dim, shape_of
from plait.capture.shard_rules import Conflict, Layout, Shard, propagate
from plait.capture.tp_layout import TP_PLACEMENT, TP_STRATEGIES, TpLayout, module_of
from plait.errors import ConfigError
from plait.tensor_parts import uneven_fits

__all__ = ["tp_layouts", "strategy_of", "embedding_nodes"]

aten = torch.ops.aten


def tp_layouts(graphs: Sequence[fx.GraphModule], tp: int, tp_plan: Mapping[str, str] | None = None,
               sequence_parallel: bool = False) -> list[TpLayout]:
    """The layout of each stage graph (all of them, so that a tied parameter is split the same way
    on every stage that holds it); `sequence_parallel`: see the module."""
    plan = dict(tp_plan or {})
    for pattern, strategy in plan.items():
        if strategy not in TP_STRATEGIES and not TP_PLACEMENT.fullmatch(strategy):
            raise ConfigError(f"tp_plan[{pattern!r}] = {strategy!r}; a strategy is one of {TP_STRATEGIES}, or the "
                              "weight's placement: 'Shard(0)', 'Shard(1)' or 'Replicate()'")
    matched: set[str] = set()
    whole: set[str] = set()  # parameters that some stage keeps whole
    words = frozenset(rows for g in graphs if (rows := _word_rows(g)) % tp and uneven_fits(rows, tp))
    for _ in range(4):
        layouts = [_layout(g, tp, plan, matched, whole, sequence_parallel, words) for g in graphs]
        placed: dict[str, set[tuple[int, int] | None]] = {}
        for g, lay in zip(graphs, layouts):
            for n in g.graph.nodes:
                if n.op == "get_attr":
                    placed.setdefault(n.target, set()).add(lay.params.get(n.target))
        split_twice = {t for t, ways in placed.items() if len(ways) > 1}
        if not split_twice - whole:
            break
        whole |= split_twice
    unmatched = [p for p in plan if p not in matched]
    if unmatched:
        names = sorted({module_of(n.target) for g in graphs for n in g.graph.nodes if n.op == "get_attr"})
        raise ConfigError(f"tp_plan pattern(s) {unmatched} match no linear or embedding of the model; "
                          f"its modules with parameters are {names[:12]}{' ...' if len(names) > 12 else ''}")
    return layouts


def strategy_of(module: str, plan: Mapping[str, str], matched: set[str] | None = None) -> str | None:
    """The tp_plan entry of `module` (its first matching pattern, recorded in `matched`), or None."""
    for pattern, strategy in plan.items():
        if fnmatch.fnmatchcase(module, pattern):
            if matched is not None:
                matched.add(pattern)
            return strategy
    return None


def embedding_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's lookups of an embedding table it holds (aten.embedding on a parameter)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.embedding.default
            and isinstance(args_of(n)[0], fx.Node) and args_of(n)[0].op == "get_attr"]


def _as_strategy(given: str, linear: LinearParts | None, module: str) -> str:
    """A tp_plan entry as a strategy: a weight placement (DTensor's words) turned into the strategy
    that places it so (a linear's output-feature dimension: colwise, its input one: rowwise; an
    embedding's rows: vocab)."""
    found = TP_PLACEMENT.fullmatch(given)
    if found is None:
        return given
    if given == "Replicate()":
        return "replicate"
    dim = int(found.group(1))
    if linear is None and dim == 0:
        return "vocab"
    if linear is not None and dim in (linear.out_dim, linear.in_dim):
        return "colwise" if dim == linear.out_dim else "rowwise"
    raise ConfigError(f"tp_plan gives {module} {given!r}: its weight can be split on "
                      f"{'its rows (Shard(0))' if linear is None else f'dim {linear.out_dim} (colwise) or {linear.in_dim} (rowwise)'}")


def _word_rows(gm: fx.GraphModule) -> int:
    """The rows of the graph's largest embedding table (the words'), 0 without one."""
    return max(((shape_of(args_of(n)[0]) or (0,))[0] for n in embedding_nodes(gm)), default=0)


def _layout(gm: fx.GraphModule, tp: int, plan: Mapping[str, str], matched: set[str],
            whole: set[str], sequence_parallel: bool, words: frozenset[int] = frozenset()) -> TpLayout:
    """The layout, with a parameter kept whole when an operation that does not split it reads it;
    `words`: vocabulary sizes that do not divide by tp, whose rows and linears split unevenly."""
    whole = set(whole)
    while True:
        layout = _layout_once(gm, tp, plan, matched, whole, sequence_parallel, words)
        readers: dict[str, set[tuple[int, int] | None]] = {}
        for n in gm.graph.nodes:
            if n.op == "get_attr" and n.target in layout.params:
                for user in n.users:
                    role = layout.roles.get(user.name)
                    readers.setdefault(n.target, set()).add(layout.params[n.target] if role else None)
        mixed = {t for t, ways in readers.items() if len(ways) > 1}
        if not mixed:
            return layout
        whole |= mixed


def _layout_once(gm: fx.GraphModule, tp: int, plan: Mapping[str, str], matched: set[str],
                 whole: set[str], sequence_parallel: bool, words: frozenset[int]) -> TpLayout:
    nodes = list(gm.graph.nodes)
    linears = {n: p for n in nodes if (p := linear_parts(n)) is not None}
    embeddings = embedding_nodes(gm)
    fixed = {n: _as_strategy(s, linears.get(n), module_of(str((linears[n].weight if n in linears else args_of(n)[0]).target)))
             for n in [*linears, *embeddings]
             if (s := strategy_of(module_of(str((linears[n].weight if n in linears else args_of(n)[0]).target)),
                                plan, matched)) is not None}
    col: set[fx.Node] = set()
    for n, p in linears.items():
        out = (shape_of(p.weight) or (0, 0))[p.out_dim]
        wanted = fixed.get(n)
        fits = out % tp == 0 or out in words  # (the LM head over a vocabulary cut unevenly)
        if wanted in ("colwise", "vocab") and not fits:
            raise ConfigError(f"tp_plan gives {module_of(str(p.weight.target))} {wanted!r} but its "
                              f"{out} output features do not divide by tp={tp}; use 'replicate' or another tp")
        if fits and wanted not in ("replicate", "rowwise") and p.weight.target not in whole:
            col.add(n)
    uneven: list[tuple[str, str]] = []
    vocab = _vocab(embeddings, linears, fixed, tp, whole, uneven)
    why: dict[fx.Node, str] = {}
    gathered: set[fx.Node] = set()
    entries: dict[fx.Node, tuple[fx.Node, int]] = {}
    for _ in range(len(col) + len(nodes) + 2):
        roles: dict[fx.Node, str] = {}
        entries = _seq_entries(linears, tp) if sequence_parallel else {}
        try:
            values = propagate(nodes, _start(linears, col, vocab, fixed, roles, tp, entries), tp, frozenset(gathered))
        except Conflict as conflict:
            scattered = {n.name for n in entries if roles.get(n) == "rowwise"}
            if conflict.sources and conflict.sources <= scattered and conflict.node not in gathered:
                # tokens split by sequence parallelism: gather them for this operation
                gathered.add(conflict.node)
                continue
            bad = {n for n in col if n.name in conflict.sources}
            forced = [n for n in bad if fixed.get(n) in ("colwise", "vocab")]
            if forced or not bad:
                name = module_of(str(linears[forced[0]].weight.target)) if forced else conflict.node.name
                raise ConfigError(f"tp_plan: {name} cannot run split: {conflict}; use 'replicate' for it "
                                  "or give the whole block's strategies") from None
            for n in bad:
                why[n] = conflict.why
            col -= bad
            continue
        break
    params: dict[str, tuple[int, int]] = {}
    for n, role in roles.items():
        if role == "vocab":
            params[str(args_of(n)[0].target)] = (0, 1)
            continue
        p = linears[n]
        if role == "colwise":
            blocks = _blocks(n, tp)
            params[str(p.weight.target)] = (p.out_dim, blocks)
            if p.bias is not None:
                params[str(p.bias.target)] = (0, blocks)
        else:
            lay = values[p.x]
            params[str(p.weight.target)] = (p.in_dim, lay.blocks if isinstance(lay, Shard) else 1)
    replicated = tuple((module_of(str(linears[n].weight.target)), w) for n, w in why.items()) + tuple(uneven)
    return TpLayout(tp, {n.name: r for n, r in roles.items()}, params,
                    {n.name: v for n, v in values.items() if v is not None}, replicated,
                    seq_entries={n.name: (e.name, d) for n, (e, d) in entries.items() if roles.get(n) == "rowwise"},
                    gathers=frozenset(n.name for n in gathered))


def _seq_entries(linears: Mapping[fx.Node, LinearParts], tp: int) -> dict[fx.Node, tuple[fx.Node, int]]:
    """Sequence parallelism: for each linear, the value its (row-parallel) partial sums are
    reduce-scattered at, and along which dimension -- the tokens (dim -2) of its output, or of the
    view that gives a flattened (tokens, features) output its (batch, sequence, features) shape back
    (Conv1D); only where that dimension's size is fixed and divides by tp."""
    found: dict[fx.Node, tuple[fx.Node, int]] = {}
    for node in linears:
        value = node
        while len(shape_of(value) or ()) < 3 and len(value.users) == 1:
            [user] = value.users
            if user.op != "call_function" or user.target not in _FOLLOW - {aten.clone.default, aten.contiguous.default}:
                break
            value = user
        shape = shape_of(value) or ()
        if len(shape) < 3 or shape[-1] != (shape_of(node) or (0,))[-1]:
            continue
        dim = len(shape) - 2
        sizes = args_of(value)[1] if value is not node else None
        symbolic = isinstance(sizes, (list, tuple)) and dim < len(sizes) and not isinstance(sizes[dim], int)
        if shape[dim] > 0 and shape[dim] % tp == 0 and not symbolic:
            found[node] = (value, dim)
    return found


def _vocab(embeddings: list[fx.Node], linears: Mapping[fx.Node, LinearParts], fixed: Mapping[fx.Node, str],
           tp: int, whole: set[str], uneven: list[tuple[str, str]]) -> set[fx.Node]:
    """Embeddings split by rows: those tp_plan names "vocab", else the largest one (the words'),
    evenly or not, unless tp ranks would leave the last none (then added to `uneven` with the reason)."""
    chosen = {n for n in embeddings if fixed.get(n) == "vocab"}
    for n in chosen:
        rows = (shape_of(args_of(n)[0]) or (0,))[0]
        if rows % tp and not uneven_fits(rows, tp):
            raise ConfigError(f"tp_plan gives {module_of(str(args_of(n)[0].target))} 'vocab' but its {rows} "
                              f"rows cut in parts of {-(-rows // tp)} leave rank {tp - 1} none at tp={tp}; "
                              "use 'replicate' or another tp")
    free = [n for n in embeddings if n not in fixed and str(args_of(n)[0].target) not in whole]
    if free and not chosen:
        largest = max(free, key=lambda n: math.prod(shape_of(args_of(n)[0]) or (0,)))
        rows = (shape_of(args_of(largest)[0]) or (1,))[0]
        if rows % tp == 0 or uneven_fits(rows, tp):
            chosen.add(largest)
        else:  # parts of ceil(rows / tp) rows, as Megatron's padded vocabulary holds them, leave the last none
            uneven.append((module_of(str(args_of(largest)[0].target)),
                           f"its {rows} rows cut in parts of {-(-rows // tp)} leave rank {tp - 1} none at tp={tp}"))
    return chosen


def _start(linears: Mapping[fx.Node, LinearParts], col: set[fx.Node], vocab: set[fx.Node],
           fixed: Mapping[fx.Node, str], roles: dict[fx.Node, str], tp: int,
           entries: Mapping[fx.Node, tuple[fx.Node, int]],
           ) -> Callable[[fx.Node, Callable[[Any], Layout]], Layout | bool]:
    at = {value: (rowwise, dim) for rowwise, (value, dim) in entries.items()}

    def start(node: fx.Node, layout_of: Callable[[Any], Layout]) -> Layout | bool:
        found = at.get(node)
        if found is not None and roles.get(found[0]) == "rowwise":  # sequence parallel: its tokens split
            rowwise, dim = found
            if node is not rowwise and layout_of(args_of(node)[0]) is not None:
                raise Conflict(node, frozenset(), "a view of a split row-parallel sum")
            return Shard(dim, 1, frozenset({rowwise.name}), seq=True)
        if node in vocab:
            roles[node] = "vocab"
            return None
        p = linears.get(node)
        if p is None:
            return False
        x = layout_of(p.x)
        rank = len(shape_of(p.x) or ())
        if x is None:
            if node in col:
                roles[node] = "colwise"
                return Shard(len(shape_of(node) or (0,)) - 1, _blocks(node, tp), frozenset({node.name}))
            return None
        in_features = (shape_of(p.weight) or (0, 0))[p.in_dim]
        if isinstance(x, Shard) and x.dim == rank - 1 and in_features % (tp * x.blocks) == 0 \
                and fixed.get(node) not in ("replicate", "colwise", "vocab"):
            roles[node] = "rowwise"
            entry = entries.get(node)
            if entry is not None and entry[0] is node:  # sequence parallel: reduce-scattered over its tokens
                return Shard(entry[1], 1, frozenset({node.name}), seq=True)
            return None
        raise Conflict(node, x.sources if isinstance(x, Shard) else frozenset(), "a linear over a split input")
    return start


_FOLLOW = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default,
           aten.clone.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def _blocks(node: fx.Node, tp: int) -> int:
    """The blocks of a column-parallel output: k when views of it are cut into k equal pieces
    along the features (a fused q|k|v), else 1."""
    dim = len(shape_of(node) or (0,)) - 1
    seen = [(node, dim)]
    while seen:
        value, d = seen.pop()
        for user in value.users:
            if user.op != "call_function":
                continue
            if user.target in _SPLITS:
                pieces = user.meta.get("val", ())
                along = (args_of(user)[2] if len(args_of(user)) > 2 else kwargs_of(user).get("dim", 0)) % len(shape_of(value) or (1,))
                sizes = {tuple(p.shape)[d] for p in pieces}
                if along == d and len(sizes) == 1 and len(pieces) > 1:
                    size = (shape_of(value) or ())[d]
                    if (size // len(pieces)) % tp == 0:
                        return len(pieces)
            elif user.target in _FOLLOW:
                before, after = shape_of(value), shape_of(user)
                e = reshape_dim(before, after, d, tp, 1) if before and after else None
                if e is not None:
                    seen.append((user, e))
    return 1
