"""Tests for plait.search.intra_op: the ILP against brute force and a chain DP, pins, memory limits,
validation; and on plait.search.tp_strategies' transformer block, that it finds Megatron's layout."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from plait.cost.network import Link
from plait.errors import ConfigError
from plait.search.intra_op import (
    Edge,
    Operator,
    OpGraph,
    Solution,
    Strategy,
    brute_force,
    evaluate,
    least_memory,
    solve,
)
from plait.search.tp_strategies import MEGATRON_LAYOUT, BlockShape, TpMesh, collectives, transformer_block

# A GPT-3 6.7B-sized block (hidden 4096, 32 heads), 2 sequences of 2048, on NVLink-class links
# and a device sustaining 300 TFLOP/s: Megatron's layout is the unique optimum at tp 2 and 4.
SHAPE = BlockShape(hidden=4096, heads=32, tokens=4096, seq_len=2048)
NVLINK = Link(latency_s=5e-6, bandwidth=150e9)


def mesh(tp: int, link: Link = NVLINK) -> TpMesh:
    return TpMesh(tp, link, flops_per_s=3e14)


def megatron(graph: OpGraph) -> dict[str, str]:
    return {op.name: MEGATRON_LAYOUT.get(op.name, "replicate") for op in graph.operators}


def random_graph(rng: random.Random) -> OpGraph:
    names = [f"op{k}" for k in range(rng.randint(3, 6))]
    operators = [Operator(name, tuple(Strategy(f"s{i}", rng.random(), rng.random() * 0.5, rng.uniform(0, 10))
                                      for i in range(rng.randint(2, 3)))) for name in names]
    sizes = {op.name: len(op.strategies) for op in operators}
    pairs = [(u, v) for a, u in enumerate(names) for v in names[a + 1:] if rng.random() < 0.5]
    if rng.random() < 0.3:  # a back edge: the ILP does not need a DAG
        pairs.append((names[-1], names[0]))
    edges = [Edge(u, v, tuple(tuple(rng.uniform(0, 2) for _ in range(sizes[v])) for _ in range(sizes[u])))
             for u, v in pairs]
    return OpGraph(tuple(operators), tuple(edges))


@pytest.mark.parametrize("seed", range(50))
def test_the_ilp_finds_brute_forces_minimum_on_random_graphs(seed: int) -> None:
    rng = random.Random(seed)
    graph = random_graph(rng)
    limit = None
    if seed % 2:  # somewhere between the leanest and the fattest choice
        most = sum(max(s.memory_bytes for s in op.strategies) for op in graph.operators)
        limit = rng.uniform(least_memory(graph), most)
    found, best = solve(graph, limit), brute_force(graph, limit)
    assert found.total_s == pytest.approx(best.total_s, rel=1e-9, abs=1e-12)
    assert evaluate(graph, found.choice).total_s == pytest.approx(found.total_s, rel=1e-12)
    if limit is not None:
        assert found.memory_bytes <= limit * (1 + 1e-7)


def forbidding(graph: OpGraph, rng: random.Random) -> OpGraph:
    """The graph with some of its edges' pairs not allowed (infinite), each row keeping one."""
    edges = []
    for e in graph.edges:
        rows = []
        for row in e.resharding_s:
            keep = rng.randrange(len(row))
            rows.append(tuple(v if j == keep or rng.random() < 0.5 else math.inf for j, v in enumerate(row)))
        edges.append(Edge(e.producer, e.consumer, tuple(rows)))
    return OpGraph(graph.operators, tuple(edges))


@pytest.mark.parametrize("seed", range(20))
def test_pairs_an_edge_does_not_allow_are_never_chosen(seed: int) -> None:
    rng = random.Random(1000 + seed)
    graph = forbidding(random_graph(rng), rng)
    try:
        best = brute_force(graph)
    except ConfigError as e:  # no choice keeps every edge allowed: the ILP says so too
        assert "does not allow" in str(e)
        with pytest.raises(ConfigError, match="does not allow"):
            solve(graph)
        return
    found = solve(graph)
    assert math.isfinite(found.total_s)
    assert found.total_s == pytest.approx(best.total_s, rel=1e-9, abs=1e-12)


def test_a_forbidden_pair_ties_two_operators_together() -> None:
    # b is cheaper split, a is cheaper whole; they may only run alike: the cheaper pair wins
    a = Operator("a", (Strategy("whole", 1.0), Strategy("split", 1.5)))
    b = Operator("b", (Strategy("whole", 3.0), Strategy("split", 1.0)))
    tie = Edge("a", "b", ((0.0, math.inf), (math.inf, 0.0)))
    graph = OpGraph((a, b), (tie,))
    assert solve(graph).choice == brute_force(graph).choice == {"a": "split", "b": "split"}
    assert evaluate(graph, {"a": "whole", "b": "split"}).total_s == math.inf
    assert solve(graph, fixed={"a": "whole"}).choice == {"a": "whole", "b": "whole"}


def scaled(graph: OpGraph, factor: float) -> OpGraph:
    return OpGraph(tuple(Operator(op.name, tuple(Strategy(s.name, s.compute_s * factor, s.communication_s * factor,
                                                          s.memory_bytes) for s in op.strategies))
                         for op in graph.operators),
                   tuple(Edge(e.producer, e.consumer, tuple(tuple(v * factor for v in row) for row in e.resharding_s))
                         for e in graph.edges))


def test_the_ilp_is_exact_on_microsecond_costs() -> None:
    # HiGHS stops within an absolute gap of 1e-6: unscaled, every choice of microsecond
    # operators would look optimal. The objective is scaled to the costliest choice.
    for seed in range(20):
        graph = scaled(random_graph(random.Random(seed)), 1e-6)
        assert solve(graph).total_s == pytest.approx(brute_force(graph).total_s, rel=1e-9)


def test_the_ilp_finds_a_long_chains_optimum_as_a_dynamic_program_does() -> None:
    # A path graph is solved exactly by a Viterbi pass: a reference beyond brute force's reach.
    rng = random.Random(7)
    n, k = 200, 4
    ops = [Operator(f"v{a}", tuple(Strategy(f"s{i}", rng.random()) for i in range(k))) for a in range(n)]
    edges = [Edge(f"v{a}", f"v{a + 1}", tuple(tuple(rng.uniform(0, 3) for _ in range(k)) for _ in range(k)))
             for a in range(n - 1)]
    best = [s.compute_s for s in ops[0].strategies]
    for a in range(1, n):
        best = [ops[a].strategies[j].compute_s + min(best[i] + edges[a - 1].resharding_s[i][j] for i in range(k))
                for j in range(k)]
    assert solve(OpGraph(tuple(ops), tuple(edges))).total_s == pytest.approx(min(best), rel=1e-9)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_transformer_block_gets_megatrons_layout(tp: int) -> None:
    graph = transformer_block(SHAPE, mesh(tp))
    found = solve(graph)
    assert found.choice == megatron(graph)
    assert found.total_s == pytest.approx(brute_force(graph).total_s, rel=1e-12)
    kinds = [(c.producer, c.consumer, c.kind, c.direction) for c in collectives(SHAPE, mesh(tp), found.choice)]
    assert [k for k in kinds if k[3] == "forward"] == [
        ("out_proj", "add1", "all-reduce", "forward"), ("proj", "add2", "all-reduce", "forward")]
    assert [k for k in kinds if k[3] == "backward"] == [  # Megatron's f: qkv's and fc's input gradients
        ("ln1", "qkv", "all-reduce", "backward"), ("ln2", "fc", "all-reduce", "backward")]
    # split: the weights on a device are 1/tp of the linears' (+ the replicated layer norms')
    h = SHAPE.hidden
    assert found.memory_bytes == pytest.approx(2 * (12 * h * h / tp + 4 * h))


@pytest.mark.parametrize("tp", [2, 4])
def test_forward_only_megatron_ties_with_a_colwise_out_proj_between_all_gathers(tp: int) -> None:
    # Two all-gathers of T/p cost one all-reduce of T: forward only, the optimum is not unique;
    # Megatron's layout is among the optima. The backward breaks the tie (previous test).
    graph = transformer_block(SHAPE, mesh(tp), training=False)
    found = solve(graph)
    assert found.total_s == pytest.approx(evaluate(graph, megatron(graph)).total_s, rel=1e-9)
    other = dict(megatron(graph), out_proj="colwise")
    assert evaluate(graph, other).total_s == pytest.approx(found.total_s, rel=1e-9)
    assert found.choice["fc"] == "colwise" and found.choice["proj"] == "rowwise"


def test_attention_stays_replicated_when_heads_do_not_divide_by_tp() -> None:
    link = Link(5e-6, 150e9)
    split = solve(transformer_block(BlockShape(hidden=1536, heads=16, tokens=8192, seq_len=2048), mesh(8, link)))
    assert split.choice["attention"] == "heads"  # the same block with 16 heads: split by heads
    graph = transformer_block(BlockShape(hidden=1536, heads=12, tokens=8192, seq_len=2048), mesh(8, link))
    assert [s.name for s in graph.operator("attention").strategies] == ["replicate"]
    found = solve(graph)
    assert found.choice["attention"] == "replicate"
    assert (found.choice["fc"], found.choice["proj"]) == ("colwise", "rowwise")  # the MLP still splits
    assert found.total_s == pytest.approx(brute_force(graph).total_s, rel=1e-12)


def test_pins_are_kept_and_move_the_optimum() -> None:
    graph = transformer_block(SHAPE, mesh(4))
    free = solve(graph)
    pinned = solve(graph, fixed={"fc": "rowwise"})
    assert pinned.choice["fc"] == "rowwise"
    assert pinned.total_s > free.total_s
    assert pinned.total_s == pytest.approx(brute_force(graph, fixed={"fc": "rowwise"}).total_s, rel=1e-12)
    # Over a 25 GB/s link, attention pinned whole takes its neighbours with it: a colwise qkv
    # would need its 3h-wide output gathered, and out_proj then reads a replicated input.
    slower = transformer_block(SHAPE, mesh(4, Link(5e-6, 25e9)))
    assert solve(slower).choice == megatron(slower)
    whole = solve(slower, fixed={"attention": "replicate"})
    assert whole.choice == dict(megatron(slower), qkv="replicate", attention="replicate", out_proj="replicate")
    assert whole.total_s == pytest.approx(brute_force(slower, fixed={"attention": "replicate"}).total_s, rel=1e-12)
    everything = solve(graph, fixed=megatron(graph))
    assert everything.choice == megatron(graph)


def test_a_memory_limit_forces_the_split_and_an_impossible_one_names_the_least() -> None:
    slow = mesh(4, Link(latency_s=1e-4, bandwidth=1e8))  # so slow that, unlimited, nothing splits
    graph = transformer_block(SHAPE, slow)
    assert set(solve(graph).choice.values()) == {"replicate"}
    least = least_memory(graph)
    forced = solve(graph, memory_limit_bytes=least * 1.001)
    assert forced.choice == megatron(graph)  # the split with the least communication
    assert forced.total_s == pytest.approx(brute_force(graph, least * 1.001).total_s, rel=1e-12)
    with pytest.raises(ConfigError, match=re.escape(f"the least any choice needs is {least:.6g} bytes")):
        solve(graph, memory_limit_bytes=least * 0.999)
    with pytest.raises(ConfigError, match="the least any choice needs with the pins"):
        brute_force(graph, memory_limit_bytes=least * 1.001, fixed={"fc": "replicate"})


def test_a_solution_adds_up_its_parts_and_is_json_ready() -> None:
    # a: x costs 1 + 0.5 and 2 to reshard into b; y costs 3 and reshards for free; b costs 1
    graph = OpGraph((Operator("a", (Strategy("x", 1.0, 0.5, 10.0), Strategy("y", 3.0, 0.0, 4.0))),
                     Operator("b", (Strategy("x", 1.0),))), (Edge("a", "b", ((2.0,), (0.0,))),))
    assert solve(graph) == Solution({"a": "y", "b": "x"}, 4.0, 0.0, 0.0, 4.0)
    pinned = solve(graph, fixed={"a": "x"})
    assert pinned == Solution({"a": "x", "b": "x"}, 2.0, 0.5, 2.0, 10.0) and pinned.total_s == 4.5
    assert json.loads(json.dumps(pinned.to_dict())) == {
        "choice": {"a": "x", "b": "x"}, "total_s": 4.5, "compute_s": 2.0, "communication_s": 0.5,
        "resharding_s": 2.0, "memory_bytes": 10.0}


@pytest.mark.parametrize("build, message", [
    (lambda: Operator("a", ()), "operator 'a' has no strategies"),
    (lambda: Strategy("x", -1.0), "strategy 'x': compute_s must be a finite number >= 0, got -1.0"),
    (lambda: Strategy("x", 1.0, float("nan")), "communication_s must be a finite number >= 0, got nan"),
    (lambda: Operator("a", (Strategy("x", 1.0), Strategy("x", 2.0))), "strategies with the same name"),
    (lambda: Edge("a", "b", ((1.0, -2.0),)), r"edge 'a' -> 'b': resharding_s\[0\]\[1\] must be .* got -2.0"),
    (lambda: Edge("a", "a", ((0.0,),)), "joins an operator to itself"),
    (lambda: OpGraph((Operator("a", (Strategy("x", 1.0),)),), (Edge("a", "c", ((0.0,),)),)),
     "names the unknown operator 'c'; the graph has \\['a'\\]"),
    (lambda: OpGraph((Operator("a", (Strategy("x", 1.0), Strategy("y", 1.0))), Operator("b", (Strategy("x", 1.0),))),
                     (Edge("a", "b", ((0.0, 1.0), (0.0, 1.0))),)), "shape 2 x 2; it must be 2 x 1"),
    (lambda: OpGraph((Operator("a", (Strategy("x", 1.0),)), Operator("a", (Strategy("x", 1.0),)))),
     r"\['a'\] appear more than once"),
    (lambda: OpGraph(()), "the graph has no operators"),
])
def test_bad_graphs_are_refused_with_the_value(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_bad_pins_and_limits_are_refused_with_the_value() -> None:
    graph = OpGraph((Operator("a", (Strategy("x", 1.0), Strategy("y", 2.0))),))
    with pytest.raises(ConfigError, match=r"the graph has no operator 'b'; it has \['a'\]"):
        solve(graph, fixed={"b": "x"})
    with pytest.raises(ConfigError, match=r"operator 'a' has no strategy 'z'; it has \['x', 'y'\]"):
        solve(graph, fixed={"a": "z"})
    with pytest.raises(ConfigError, match="memory_limit_bytes must be a finite number >= 0, got -1"):
        solve(graph, memory_limit_bytes=-1)
    with pytest.raises(ConfigError, match=r"missing \['a'\], unknown \['q'\]"):
        evaluate(graph, {"q": "x"})
