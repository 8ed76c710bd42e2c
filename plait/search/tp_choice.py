"""Which of a stage's splittable operations run split at tp, chosen by the intra-operator ILP.

The runtime can run each linear of a stage graph column-parallel, row-parallel or whole, and the
word embedding by vocabulary rows or whole (`plait.capture.megatron_layout`); a column-parallel linear's
split travels to the row-parallel ones it reaches, so those run split together or not at all, as
do two operations reading one tied weight. Each such operation is an operator of an `OpGraph`
(`plait.search.intra_op`) with two strategies, "replicate" and its role, priced for one training
step of the traced micro-batch on a `TpMesh`:

    compute         3 x forward FLOPs / flops_per_s        (/ tp split)
    communication   split only: the all-reduce of a row-parallel output or a vocab lookup
                    (forward), of a column-parallel input's gradient (backward, once per input),
                    the all-gather of a split value leaving the stage (ring formulas on the link)
    memory          parameter bytes x state_factor         (/ tp split); state_factor counts the
                    parameter, its gradient and the optimizer's state per parameter byte

and every pair that must run alike is an edge whose mixed pairs are not allowed (infinite). The
ILP minimises the seconds under the stage's memory limit, less what the stage holds whole anyway
(`fixed_bytes`: layer norms, position embeddings); `tp_plan` entries are pins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from plait.cost.network import all_gather, all_reduce
from plait.errors import ConfigError
from plait.search.intra_op import Edge, Operator, OpGraph, Solution, Strategy, least_memory, solve
from plait.search.tp_strategies import TpMesh

__all__ = ["TpOp", "TpSearch", "tp_graph", "choose_split"]

REPLICATE = "replicate"
_FORBIDDEN = ((0.0, math.inf), (math.inf, 0.0))  # replicate/split with replicate/split: alike only


@dataclass(frozen=True)
class TpOp:
    """A splittable operation of a stage graph (see the module) and what splitting it moves."""

    name: str  # the graph node's name
    module: str  # the user's module name
    role: str  # "colwise", "rowwise" or "vocab"
    flops: float  # forward, whole, for the traced micro-batch
    param_bytes: float  # the parameters it would split (a tied one counted at its first reader)
    forward_reduce_bytes: float = 0.0
    backward_reduce_bytes: float = 0.0
    gather_bytes: float = 0.0
    ties: tuple[str, ...] = ()  # the names of operations that must run alike with it


@dataclass(frozen=True)
class TpSearch:
    """What the ILP prices with: the tp group, the memory limit of a stage, state bytes per parameter byte."""

    mesh: TpMesh
    memory_limit_bytes: float
    state_factor: float = 4.0  # parameter, gradient and Adam's two moments

    def __post_init__(self) -> None:
        if not (isinstance(self.memory_limit_bytes, (int, float)) and 0 < self.memory_limit_bytes < math.inf):
            raise ConfigError(f"the tp search's memory_limit_bytes must be a positive number, got "
                              f"{self.memory_limit_bytes!r}")
        if not (isinstance(self.state_factor, (int, float)) and self.state_factor >= 1):
            raise ConfigError(f"the tp search's state_factor must be >= 1 (the parameter itself), got "
                              f"{self.state_factor!r}")


def tp_graph(ops: Sequence[TpOp], search: TpSearch) -> OpGraph:
    """The operators (replicate, or the op's role) and the edges tying those that run alike."""
    tp, link, flops = search.mesh.tp, search.mesh.link, search.mesh.flops_per_s
    operators = []
    for op in ops:
        whole_s = 3.0 * op.flops / flops
        talk = (all_reduce(op.forward_reduce_bytes, tp, link) + all_reduce(op.backward_reduce_bytes, tp, link)
                + all_gather(op.gather_bytes / tp, tp, link))
        state = op.param_bytes * search.state_factor
        operators.append(Operator(op.name, (Strategy(REPLICATE, whole_s, 0.0, state),
                                            Strategy(op.role, whole_s / tp, talk, state / tp))))
    names = {op.name for op in ops}
    pairs = {tuple(sorted((op.name, other))) for op in ops for other in op.ties if other in names and other != op.name}
    edges = tuple(Edge(a, b, _FORBIDDEN) for a, b in sorted(pairs))
    return OpGraph(tuple(operators), edges)


def choose_split(ops: Sequence[TpOp], search: TpSearch, fixed_bytes: float = 0.0,
                 pins: Mapping[str, str] | None = None) -> tuple[set[str], Solution]:
    """The names of the ops the ILP splits and its solution; `pins`: op name -> "replicate" or its role."""
    if not ops:
        raise ConfigError("the tp search got no splittable operations; a stage without linears runs whole")
    limit = search.memory_limit_bytes - fixed_bytes * search.state_factor
    graph = tp_graph(ops, search)
    if limit <= 0:
        raise ConfigError(
            f"memory_limit_bytes={search.memory_limit_bytes:.6g} per stage does not hold even the "
            f"{fixed_bytes * search.state_factor:.6g} bytes of state of the parameters tp cannot split "
            "(layer norms, position embeddings); raise Config.memory_limit_bytes or use more stages")
    least = least_memory(graph, pins) + fixed_bytes * search.state_factor
    if least > search.memory_limit_bytes:
        raise ConfigError(
            f"memory_limit_bytes={search.memory_limit_bytes:.6g} per stage is less than the {least:.6g} bytes of "
            f"parameter state the stage holds at its most split over tp={search.mesh.tp}"
            f"{' and the tp_plan pins ' + str(dict(pins)) if pins else ''}; raise Config.memory_limit_bytes, "
            "use a larger tp or more stages")
    solution = solve(graph, limit, dict(pins or {}))
    return {name for name, strategy in solution.choice.items() if strategy != REPLICATE}, solution
