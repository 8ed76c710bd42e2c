r"""The intra-operator pass: one sharding strategy per operator, chosen by an integer linear program.

Alpa's formulation (Zheng et al. 2022, "Alpa: Automating Inter- and Intra-Operator Parallelism",
section 4.2). Operator v has k_v strategies; strategy i takes d_vi seconds computing, c_vi
communicating and keeps m_vi bytes on each device. Edge (u, v) carries a k_u x k_v matrix R_uv:
the seconds to turn u's output, as u's strategy i lays it out, into the layout v's strategy j
reads (and, in training, its gradient back).

    producer u:  s_u0   s_u1   s_u2        s_vi in {0, 1}: operator v runs strategy i
                    \     |     /
                  R_uv[i][j] e_uv,ij        e_uv,ij = s_ui s_vj, linearised below
                    /          \
    consumer v:  s_v0          s_v1

    minimise    sum_v sum_i (d_vi + c_vi) s_vi  +  sum_(u,v) sum_ij R_uv[i][j] e_uv,ij
    subject to  sum_i s_vi = 1                 one strategy per operator
                sum_j e_uv,ij = s_ui           with s integral and 0 <= e <= 1 these two leave
                sum_i e_uv,ij = s_vj           one e per edge at 1, the chosen (i, j): e = s_ui s_vj
                sum_v sum_i m_vi s_vi <= limit memory (when a limit is given)
                s_vi = 0 for i other than the one `fixed` pins v to, if any
                e_uv,ij = 0 where R_uv[i][j] is infinite: the runtime cannot turn i's layout into j's


Only s is integral (the e follow from it), the form Alpa uses. HiGHS (scipy.optimize.milp) solves
it. HiGHS stops within an absolute gap of 1e-6, so the objective is divided by a lower bound on
the optimum (each operator's and edge's cheapest entry; at least 1e-6 of the costliest choice),
which makes that gap relative; and the memory row by the limit, so that its feasibility
tolerance (1e-7) is a fraction of the limit. The answer is re-priced exactly (`evaluate`);
`brute_force` tries every choice, the tests' reference. `plait.search.tp_strategies` builds the
graph of a transformer block on a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from plait.errors import ConfigError, PlaitError

__all__ = ["Strategy", "Operator", "Edge", "OpGraph", "Solution", "evaluate", "least_memory", "solve",
           "brute_force"]

MAX_BRUTE_FORCE = 1_000_000  # choices brute_force enumerates at most


def _check_cost(what: str, value: object, forbidden_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value < 0 \
            or (math.isinf(value) and not forbidden_ok):
        also = " (or math.inf: the pair is not allowed)" if forbidden_ok else ""
        raise ConfigError(f"{what} must be a finite number >= 0{also}, got {value!r}")


@dataclass(frozen=True)
class Strategy:
    """One way to run an operator: seconds computing and communicating, and bytes kept per device."""

    name: str
    compute_s: float
    communication_s: float = 0.0
    memory_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a strategy's name must be a non-empty string, got {self.name!r}")
        for field in ("compute_s", "communication_s", "memory_bytes"):
            _check_cost(f"strategy {self.name!r}: {field}", getattr(self, field))

    @property
    def cost_s(self) -> float:
        """Compute plus communication: the strategy's own seconds."""
        return self.compute_s + self.communication_s


@dataclass(frozen=True)
class Operator:
    """A node of the graph: its name and the strategies it may run with (at least one)."""

    name: str
    strategies: tuple[Strategy, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategies", tuple(self.strategies))
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"an operator's name must be a non-empty string, got {self.name!r}")
        if not self.strategies:
            raise ConfigError(f"operator {self.name!r} has no strategies; give it at least one "
                              "(a single 'replicate' if it cannot be split)")
        names = [s.name for s in self.strategies]
        if len(set(names)) != len(names):
            raise ConfigError(f"operator {self.name!r} has strategies with the same name: {names}")

    def index(self, strategy: str) -> int:
        """The position of the strategy called `strategy`."""
        for i, s in enumerate(self.strategies):
            if s.name == strategy:
                return i
        raise ConfigError(f"operator {self.name!r} has no strategy {strategy!r}; "
                          f"it has {[s.name for s in self.strategies]}")


@dataclass(frozen=True)
class Edge:
    """A tensor from `producer` to `consumer`: resharding_s[i][j] seconds between strategies i and j
    (math.inf: the pair cannot run together)."""

    producer: str
    consumer: str
    resharding_s: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        rows = tuple(tuple(row) for row in self.resharding_s)
        for i, row in enumerate(rows):
            for j, value in enumerate(row):
                _check_cost(f"edge {self.producer!r} -> {self.consumer!r}: resharding_s[{i}][{j}]", value, True)
        object.__setattr__(self, "resharding_s", tuple(tuple(float(v) for v in row) for row in rows))
        if self.producer == self.consumer:
            raise ConfigError(f"edge {self.producer!r} -> {self.consumer!r} joins an operator to itself; "
                              "an operator's strategy fixes its input layout, so leave the edge out")


@dataclass(frozen=True)
class OpGraph:
    """Operators and the edges between them, each edge's matrix k_producer x k_consumer."""

    operators: tuple[Operator, ...]
    edges: tuple[Edge, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "operators", tuple(self.operators))
        object.__setattr__(self, "edges", tuple(self.edges))
        names = [op.name for op in self.operators]
        if not names:
            raise ConfigError("the graph has no operators; give it at least one")
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"operator names must be unique; {twice} appear more than once")
        by_name = {op.name: op for op in self.operators}
        for edge in self.edges:
            for end in (edge.producer, edge.consumer):
                if end not in by_name:
                    raise ConfigError(f"edge {edge.producer!r} -> {edge.consumer!r} names the unknown "
                                      f"operator {end!r}; the graph has {names}")
            want = (len(by_name[edge.producer].strategies), len(by_name[edge.consumer].strategies))
            got = (len(edge.resharding_s), *{len(row) for row in edge.resharding_s})
            if got != want:
                raise ConfigError(
                    f"edge {edge.producer!r} -> {edge.consumer!r} has a resharding matrix of shape "
                    f"{_shape(edge.resharding_s)}; it must be {want[0]} x {want[1]} (producer strategies "
                    "x consumer strategies)")

    def operator(self, name: str) -> Operator:
        """The operator called `name`."""
        for op in self.operators:
            if op.name == name:
                return op
        raise ConfigError(f"the graph has no operator {name!r}; it has {[op.name for op in self.operators]}")


def _shape(matrix: tuple[tuple[float, ...], ...]) -> str:
    widths = sorted({len(row) for row in matrix})
    return f"{len(matrix)} x {widths[0] if len(widths) == 1 else widths}"


@dataclass(frozen=True)
class Solution:
    """One strategy per operator (by name, in graph order), what it costs and the bytes it keeps."""

    choice: dict[str, str]
    compute_s: float
    communication_s: float
    resharding_s: float
    memory_bytes: float

    @property
    def total_s(self) -> float:
        """The objective: compute + communication + resharding."""
        return self.compute_s + self.communication_s + self.resharding_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_s": self.total_s}


def evaluate(graph: OpGraph, choice: Mapping[str, str]) -> Solution:
    """Price a choice of one strategy (by name) for every operator of `graph`."""
    missing = [op.name for op in graph.operators if op.name not in choice]
    extra = sorted(set(choice) - {op.name for op in graph.operators})
    if missing or extra:
        raise ConfigError(f"a choice needs exactly the graph's operators; missing {missing}, unknown {extra}")
    return _price(graph, {op.name: op.index(choice[op.name]) for op in graph.operators})


def _price(graph: OpGraph, index: Mapping[str, int]) -> Solution:
    chosen = [op.strategies[index[op.name]] for op in graph.operators]
    return Solution(
        choice={op.name: s.name for op, s in zip(graph.operators, chosen)},
        compute_s=math.fsum(s.compute_s for s in chosen),
        communication_s=math.fsum(s.communication_s for s in chosen),
        resharding_s=math.fsum(e.resharding_s[index[e.producer]][index[e.consumer]] for e in graph.edges),
        memory_bytes=math.fsum(s.memory_bytes for s in chosen))


def _allowed(graph: OpGraph, fixed: Mapping[str, str] | None) -> list[list[int]]:
    """Per operator (in graph order), the strategy indices a choice keeping the `fixed` pins may take."""
    pins = {name: graph.operator(name).index(strategy) for name, strategy in (fixed or {}).items()}
    return [[pins[op.name]] if op.name in pins else list(range(len(op.strategies))) for op in graph.operators]


def least_memory(graph: OpGraph, fixed: Mapping[str, str] | None = None) -> float:
    """The fewest bytes any choice (keeping the `fixed` pins) needs: each operator's leanest strategy."""
    allowed = _allowed(graph, fixed)
    return math.fsum(min(op.strategies[i].memory_bytes for i in ids) for op, ids in zip(graph.operators, allowed))


def _check_memory(graph: OpGraph, limit: float | None, fixed: Mapping[str, str] | None) -> None:
    if limit is None:
        return
    _check_cost("memory_limit_bytes", limit)
    least = least_memory(graph, fixed)
    if least > limit:
        pinned = f" with the pins {dict(fixed)}" if fixed else ""
        raise ConfigError(
            f"no choice of strategies fits memory_limit_bytes={limit:.6g}: the least any choice needs"
            f"{pinned} is {least:.6g} bytes; raise the limit to at least that, give the operators "
            "strategies that shard more, or drop pins")


def brute_force(graph: OpGraph, memory_limit_bytes: float | None = None,
                fixed: Mapping[str, str] | None = None) -> Solution:
    """The cheapest choice by trying every one (a reference for small graphs)."""
    allowed = _allowed(graph, fixed)
    _check_memory(graph, memory_limit_bytes, fixed)
    count = math.prod(len(ids) for ids in allowed)
    if count > MAX_BRUTE_FORCE:
        raise ConfigError(f"brute_force would try {count} choices, over {MAX_BRUTE_FORCE}; use solve")
    best: Solution | None = None
    for combo in itertools.product(*allowed):
        found = _price(graph, {op.name: i for op, i in zip(graph.operators, combo)})
        fits = memory_limit_bytes is None or found.memory_bytes <= memory_limit_bytes
        if fits and math.isfinite(found.total_s) and (best is None or found.total_s < best.total_s):
            best = found
    if best is None:
        raise _no_choice(graph, memory_limit_bytes, fixed)
    return best


def _no_choice(graph: OpGraph, limit: float | None, fixed: Mapping[str, str] | None) -> ConfigError:
    """No choice both fits and keeps every edge's pair allowed."""
    pinned = f" keeping the pins {dict(fixed)}" if fixed else ""
    fits = f" within memory_limit_bytes={limit:.6g}" if limit is not None else ""
    return ConfigError(f"no choice of strategies{pinned} runs{fits}: every one that fits pairs strategies an edge "
                       "does not allow (an infinite resharding cost); drop a pin or raise the limit")


def solve(graph: OpGraph, memory_limit_bytes: float | None = None,
          fixed: Mapping[str, str] | None = None) -> Solution:
    """The cheapest choice of one strategy per operator, by Alpa's integer linear program (HiGHS)."""
    try:
        from scipy.optimize import LinearConstraint, milp  # type: ignore[import-untyped]
        from scipy.sparse import coo_array  # type: ignore[import-untyped]
    except ImportError as err:  # scipy comes with scikit-learn, a dependency; say so if it is gone
        raise ConfigError("the intra-operator ILP needs scipy (>= 1.9, for milp); pip install scipy") from err
    allowed = _allowed(graph, fixed)
    _check_memory(graph, memory_limit_bytes, fixed)

    # variables: s for every (operator, strategy), then e for every (edge, i, j)
    first: dict[str, int] = {}
    costs: list[float] = []
    for op in graph.operators:
        first[op.name] = len(costs)
        costs.extend(s.cost_s for s in op.strategies)
    num_s = len(costs)
    forbidden: list[int] = []  # the e of pairs an edge does not allow: held at 0
    for edge in graph.edges:
        for v in (v for row in edge.resharding_s for v in row):
            if math.isinf(v):
                forbidden.append(len(costs))
            costs.append(v if math.isfinite(v) else 0.0)
    least, worst = (math.fsum(pick(s.cost_s for s in op.strategies) for op in graph.operators)
                    + math.fsum(pick([v for row in e.resharding_s for v in row if math.isfinite(v)] or [0.0])
                                for e in graph.edges)
                    for pick in (min, max))  # bounds on any choice's total
    scale = max(least, worst * 1e-6) or 1.0  # the optimum is >= 1 in these units when least > 0

    rows: list[tuple[list[tuple[int, float]], float, float]] = []  # (column, coefficient)s, lower, upper
    for op in graph.operators:  # sum_i s_vi = 1
        rows.append(([(first[op.name] + i, 1.0) for i in range(len(op.strategies))], 1.0, 1.0))
    offset = num_s
    for edge in graph.edges:
        k_u, k_v = len(edge.resharding_s), len(edge.resharding_s[0])
        for i in range(k_u):  # sum_j e_ij - s_ui = 0
            rows.append(([(offset + i * k_v + j, 1.0) for j in range(k_v)] + [(first[edge.producer] + i, -1.0)], 0, 0))
        for j in range(k_v):  # sum_i e_ij - s_vj = 0
            rows.append(([(offset + i * k_v + j, 1.0) for i in range(k_u)] + [(first[edge.consumer] + j, -1.0)], 0, 0))
        offset += k_u * k_v
    if memory_limit_bytes is not None:  # sum m_vi s_vi <= limit, in units of the limit
        unit = memory_limit_bytes or 1.0
        rows.append(([(first[op.name] + i, s.memory_bytes / unit) for op in graph.operators
                      for i, s in enumerate(op.strategies)], -math.inf, memory_limit_bytes / unit))

    num_vars = len(costs)
    high_bounds = np.ones(num_vars)  # 0 for the strategies a pin rules out
    for op, ids in zip(graph.operators, allowed):
        high_bounds[[first[op.name] + i for i in range(len(op.strategies)) if i not in ids]] = 0.0
    high_bounds[forbidden] = 0.0
    integrality = np.zeros(num_vars)
    integrality[:num_s] = 1
    entries = [(r, col, value) for r, (row, _, _) in enumerate(rows) for col, value in row]
    matrix = coo_array(([e[2] for e in entries], ([e[0] for e in entries], [e[1] for e in entries])),
                       shape=(len(rows), num_vars))
    result = milp(np.asarray(costs) / scale, integrality=integrality, bounds=(np.zeros(num_vars), high_bounds),
                  constraints=LinearConstraint(matrix, [r[1] for r in rows], [r[2] for r in rows]),
                  options={"mip_rel_gap": 1e-9})
    if result.status == 2:  # infeasible
        raise _no_choice(graph, memory_limit_bytes, fixed)
    if result.status != 0 or result.x is None:
        raise PlaitError(f"HiGHS found no optimum (status {result.status}: {result.message}) for a graph of "
                         f"{len(graph.operators)} operators and {len(graph.edges)} edges")
    x = np.asarray(result.x, dtype=float)
    index = {op.name: int(np.argmax(x[first[op.name]:first[op.name] + len(op.strategies)]))
             for op in graph.operators}
    return _price(graph, index)
