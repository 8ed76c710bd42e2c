"""Megatron-style tensor-parallel strategies of a transformer block, as an `OpGraph` for the intra-op ILP.

A (tokens, features) activation lies on a group of tp devices in one of three layouts:

    R  replicated   every device holds all of it
    S  sharded      on the last dim: device r holds features [r F/tp, (r+1) F/tp) -- for q, k, v and
                    the attention output, the features of heads [r H/tp, (r+1) H/tp) (a fused qkv
                    weight is stored so that each device's columns are its heads' q, k and v, as
                    Megatron's is)
    P  partial      every device holds a full-size summand; the tensor is their sum

Strategies (forward: the input layout read -> the output layout given; backward: the layout the
input's gradient comes out in; "split": FLOPs and weights / tp, else whole on every device):

    linear     replicate  R -> R  grad R
               colwise    R -> S  grad P    W split on output features (Megatron's A in XA)
               rowwise    S -> P  grad S    W split on input features (Megatron's B in YB)
    attention  replicate  R -> R  grad R
               heads      S -> S  grad S    only when heads % tp == 0
    gelu       replicate  R -> R  grad R;   sharded  S -> S  grad S
    layernorm, residual add, block input and output: replicate only

A layer norm needs the whole feature dim. A residual add is kept replicated on purpose: sharding
it would turn each all-reduce into a reduce-scatter + all-gather costing the same here, cheaper
by the add's sliver of compute -- Megatron's later sequence parallelism (Korthikanti et al.
2022), which shards the sequence dim and earns its keep in activation memory, not counted here.

Resharding T bytes (ring collectives, `plait.cost.network`; alpha latency, B bandwidth, p = tp):

    R -> R, S -> S, R -> S   free (R -> S is a local slice)
    S -> R   all-gather      (p-1) alpha + (p-1) T/(p B)
    P -> R   all-reduce      2(p-1) alpha + 2(p-1) T/(p B)
    P -> S   reduce-scatter  (p-1) alpha + (p-1) T/(p B)

In training an edge also carries the gradient back, by the same table, from the layout the
consumer's strategy gives it in to the one the producer needs (R's gradient is R, S's is S, P's
is R); compute is then 3x the forward's (forward + two backward matmuls).

The block (pre-layer-norm GPT), each arrow an edge:

    input -> ln1 -> qkv -> attention -> out_proj -> add1 -> ln2 -> fc -> gelu -> proj -> add2 -> output
      |______________________________________________^ |__________________________________^

Megatron-LM's layout (Shoeybi et al. 2019, section 3): qkv colwise, attention by heads, out_proj
rowwise, fc colwise, gelu sharded, proj rowwise -- one all-reduce after out_proj and after proj
forward, one at qkv's and at fc's input backward. Forward only, out_proj (or proj) colwise between
two all-gathers ties with rowwise + all-reduce; the backward breaks the tie (colwise's input
gradient is partial and needs its own all-reduce). Left out: biases, softmax FLOPs, causal
masking's saving, activation memory (memory is the weights' bytes on a device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from plait.cost.network import Link, all_gather, all_reduce, reduce_scatter
from plait.errors import ConfigError
from plait.search.intra_op import Edge, Operator, OpGraph, Strategy

__all__ = ["Layout", "BlockShape", "TpMesh", "TpStrategy", "Collective", "MEGATRON_LAYOUT", "reshard",
           "block_strategies", "transformer_block", "collectives"]

Layout = Literal["R", "S", "P"]
GRAD_NEEDED: dict[str, Layout] = {"R": "R", "S": "S", "P": "R"}  # output layout -> its gradient's
LAYERNORM_FLOPS, GELU_FLOPS, ADD_FLOPS = 8, 8, 1  # per element, rough: these ops are memory-bound anyway
MEGATRON_LAYOUT = {"qkv": "colwise", "attention": "heads", "out_proj": "rowwise",
                   "fc": "colwise", "gelu": "sharded", "proj": "rowwise"}


@dataclass(frozen=True)
class BlockShape:
    """A transformer block's sizes: features, heads, tokens per step, and bytes per element."""

    hidden: int
    heads: int
    tokens: int  # batch x sequence
    seq_len: int | None = None  # tokens per sequence, for attention's FLOPs; None: one sequence
    ffn_hidden: int | None = None  # the MLP's inner width; None: 4 x hidden
    dtype_bytes: int = 2  # bf16

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "tokens", "seq_len", "ffn_hidden", "dtype_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"BlockShape.{name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden={self.hidden} is not a multiple of heads={self.heads}; "
                              "each head needs hidden / heads features")

    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return self.ffn_hidden or 4 * self.hidden


@dataclass(frozen=True)
class TpMesh:
    """A tensor-parallel group: `tp` devices of `flops_per_s` each, joined by `link`."""

    tp: int
    link: Link
    flops_per_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"TpMesh.tp must be a positive integer, got {self.tp!r}")
        if not (isinstance(self.flops_per_s, (int, float)) and 0 < self.flops_per_s < float("inf")):
            raise ConfigError(f"TpMesh.flops_per_s must be a finite number > 0, got {self.flops_per_s!r}; "
                              "for example 3e14 for a GPU's bf16 matmuls")


@dataclass(frozen=True)
class TpStrategy:
    """A strategy's layouts: input read, output given, input gradient given; `split` divides work by tp."""

    name: str
    reads: Layout
    gives: Layout
    grad: Layout
    split: bool


@dataclass(frozen=True)
class Collective:
    """A collective a choice puts on an edge: which, in which pass, and its seconds."""

    producer: str
    consumer: str
    kind: str  # "all-gather", "all-reduce" or "reduce-scatter"
    direction: str  # "forward" or "backward"
    seconds: float


REPLICATE = TpStrategy("replicate", "R", "R", "R", False)
COLWISE = TpStrategy("colwise", "R", "S", "P", True)
ROWWISE = TpStrategy("rowwise", "S", "P", "S", True)
HEADS = TpStrategy("heads", "S", "S", "S", True)
SHARDED = TpStrategy("sharded", "S", "S", "S", True)


def reshard(src: Layout, dst: Layout, nbytes: float, tp: int, link: Link) -> tuple[str | None, float]:
    """The collective (None: none) and seconds to turn a tensor of `nbytes` from layout `src` to `dst`."""
    if dst == "P":
        raise ConfigError(f"no strategy reads a partial sum ({src} -> {dst}); read R or S")
    if src == dst or src == "R":
        return None, 0.0
    if src == "S":  # S -> R: each device sends its T/p on
        return "all-gather", all_gather(nbytes / tp, tp, link)
    if dst == "R":
        return "all-reduce", all_reduce(nbytes, tp, link)
    return "reduce-scatter", reduce_scatter(nbytes, tp, link)


@dataclass(frozen=True)
class _Op:
    flops: float  # forward
    params: int  # weights, whole
    out_features: int  # of its output tensor
    strategies: tuple[TpStrategy, ...]


def _block(shape: BlockShape, tp: int) -> tuple[dict[str, _Op], list[tuple[str, str]]]:
    """The block's operators (FLOPs, weights, output width, strategies) and edges, for a group of tp."""
    h, f, t = shape.hidden, shape.ffn, shape.tokens
    seq = shape.seq_len or t

    def linear(n_in: int, n_out: int) -> _Op:
        ways = (REPLICATE,) + ((COLWISE,) if n_out % tp == 0 else ()) + ((ROWWISE,) if n_in % tp == 0 else ())
        return _Op(2.0 * t * n_in * n_out, n_in * n_out, n_out, ways)

    one = (REPLICATE,)
    ops = {
        "input": _Op(0.0, 0, h, one),
        "ln1": _Op(LAYERNORM_FLOPS * t * h, 2 * h, h, one),
        "qkv": _Op(2.0 * t * h * 3 * h, 3 * h * h, 3 * h, (REPLICATE,) + ((COLWISE,) if h % tp == 0 else ())
                   + ((ROWWISE,) if h % tp == 0 else ())),
        "attention": _Op(4.0 * t * seq * h, 0, h, one + ((HEADS,) if shape.heads % tp == 0 else ())),
        "out_proj": linear(h, h),
        "add1": _Op(ADD_FLOPS * t * h, 0, h, one),
        "ln2": _Op(LAYERNORM_FLOPS * t * h, 2 * h, h, one),
        "fc": linear(h, f),
        "gelu": _Op(GELU_FLOPS * t * f, 0, f, one + ((SHARDED,) if f % tp == 0 else ())),
        "proj": linear(f, h),
        "add2": _Op(ADD_FLOPS * t * h, 0, h, one),
        "output": _Op(0.0, 0, h, one),
    }
    chain = ["input", "ln1", "qkv", "attention", "out_proj", "add1", "ln2", "fc", "gelu", "proj", "add2", "output"]
    edges = list(zip(chain, chain[1:])) + [("input", "add1"), ("add1", "add2")]
    return ops, edges


def block_strategies(shape: BlockShape, tp: int) -> dict[str, tuple[TpStrategy, ...]]:
    """Each operator of the block and the strategies open to it on a group of `tp` devices."""
    return {name: op.strategies for name, op in _block(shape, tp)[0].items()}


def _edge_collectives(src: TpStrategy, dst: TpStrategy, nbytes: float, mesh: TpMesh,
                      training: bool) -> list[tuple[str, str, float]]:
    """(kind, direction, seconds) of the collectives between a producer's and a consumer's strategy."""
    found = [(kind, "forward", s) for kind, s in [reshard(src.gives, dst.reads, nbytes, mesh.tp, mesh.link)]
             if kind]
    if training:
        kind, s = reshard(dst.grad, GRAD_NEEDED[src.gives], nbytes, mesh.tp, mesh.link)
        if kind:
            found.append((kind, "backward", s))
    return found


def transformer_block(shape: BlockShape, mesh: TpMesh, training: bool = True) -> OpGraph:
    """The `OpGraph` of one transformer block on `mesh`: forward only, or forward and backward."""
    ops, edges = _block(shape, mesh.tp)
    passes = 3.0 if training else 1.0
    operators = tuple(
        Operator(name, tuple(
            Strategy(s.name, passes * op.flops / (mesh.tp if s.split else 1) / mesh.flops_per_s, 0.0,
                     op.params * shape.dtype_bytes / (mesh.tp if s.split else 1))
            for s in op.strategies))
        for name, op in ops.items())
    graph_edges = []
    for u, v in edges:
        nbytes = float(shape.tokens * ops[u].out_features * shape.dtype_bytes)
        matrix = tuple(tuple(sum(c[2] for c in _edge_collectives(a, b, nbytes, mesh, training))
                             for b in ops[v].strategies) for a in ops[u].strategies)
        graph_edges.append(Edge(u, v, matrix))
    return OpGraph(operators, tuple(graph_edges))


def collectives(shape: BlockShape, mesh: TpMesh, choice: Mapping[str, str],
                training: bool = True) -> list[Collective]:
    """The collectives a choice of strategies (a `Solution.choice`) puts on the block's edges."""
    ops, edges = _block(shape, mesh.tp)
    unknown = sorted(set(choice) - set(ops))
    if unknown:
        raise ConfigError(f"the choice names operators the block does not have: {unknown}; it has {list(ops)}")
    picked: dict[str, TpStrategy] = {}
    for name, op in ops.items():
        wanted = choice.get(name, "replicate")
        matches = [s for s in op.strategies if s.name == wanted]
        if not matches:
            raise ConfigError(f"operator {name!r} has no strategy {wanted!r} at tp={mesh.tp}; "
                              f"it has {[s.name for s in op.strategies]}")
        picked[name] = matches[0]
    found = []
    for u, v in edges:
        nbytes = float(shape.tokens * ops[u].out_features * shape.dtype_bytes)
        for kind, direction, seconds in _edge_collectives(picked[u], picked[v], nbytes, mesh, training):
            found.append(Collective(u, v, kind, direction, seconds))
    return found
