"""Tests for plait.search.tp_choice: the tp search's graph and choice over a stage's splittable ops --
against brute force, ties kept, pins fixed, memory limits, errors naming the value."""

from __future__ import annotations

import random

import pytest

from plait.cost.network import Link
from plait.errors import ConfigError
from plait.search.intra_op import brute_force, evaluate
from plait.search.tp_choice import TpOp, TpSearch, choose_split, tp_graph
from plait.search.tp_strategies import TpMesh

SLOW = TpMesh(2, Link(50e-6, 2e9), 5e10)  # the CPU preset's gloo link and FLOP/s
FAST = TpMesh(2, Link(0.0, 1e15), 5e10)  # free collectives


def block(i: int, width: int = 64, rows: int = 16) -> list[TpOp]:
    """An MLP: a column-parallel up projection and the row-parallel down one reading its split."""
    up = TpOp(f"up{i}", f"h.{i}.up", "colwise", 2.0 * rows * width * 4 * width, 4.0 * width * 4 * width,
              backward_reduce_bytes=4.0 * rows * width)
    down = TpOp(f"down{i}", f"h.{i}.down", "rowwise", 2.0 * rows * width * 4 * width, 4.0 * 4 * width * width,
                forward_reduce_bytes=4.0 * rows * width, ties=(f"up{i}",))
    return [up, down]


def state(ops: list[TpOp], split: set[str], tp: int, factor: float) -> float:
    return sum(op.param_bytes * factor / (tp if op.name in split else 1) for op in ops)


def test_without_memory_pressure_the_slow_link_keeps_small_blocks_whole_and_free_collectives_split_them() -> None:
    ops = block(0) + block(1)
    roomy = 1e12
    assert choose_split(ops, TpSearch(SLOW, roomy, 2.0))[0] == set()
    assert choose_split(ops, TpSearch(FAST, roomy, 2.0))[0] == {"up0", "down0", "up1", "down1"}


def test_a_memory_limit_splits_just_enough_and_ties_run_alike() -> None:
    ops = block(0) + block(1, width=128)
    whole = state(ops, set(), 2, 2.0)
    # room for everything whole but 70% of the bigger block's state: only it has to split
    big = sum(op.param_bytes for op in ops[2:]) * 2.0
    limit = whole - 0.3 * big
    split, solution = choose_split(ops, TpSearch(SLOW, limit, 2.0))
    assert split == {"up1", "down1"}
    assert solution.memory_bytes == pytest.approx(state(ops, split, 2, 2.0)) and solution.memory_bytes <= limit


@pytest.mark.parametrize("seed", range(15))
def test_the_choice_is_brute_forces_on_random_stages(seed: int) -> None:
    rng = random.Random(seed)
    ops = [op for i in range(rng.randint(1, 4)) for op in block(i, rng.choice([32, 64, 256]), rng.choice([4, 64]))]
    if rng.random() < 0.5:  # a vocab-split embedding tied to a column-parallel head reading its weight
        ops += [TpOp("emb", "wte", "vocab", 0.0, 4.0 * 512 * 64, forward_reduce_bytes=4096.0, ties=("head",)),
                TpOp("head", "wte", "colwise", 2.0 * 64 * 64 * 512, 0.0, backward_reduce_bytes=4096.0,
                     gather_bytes=4.0 * 64 * 512, ties=("emb",))]
    fixed = rng.uniform(0, 5e4)
    search = TpSearch(rng.choice([SLOW, FAST]), 1e12, rng.choice([2.0, 3.0, 4.0]))
    least, most = state(ops, {o.name for o in ops}, 2, search.state_factor), state(ops, set(), 2, search.state_factor)
    limit = fixed * search.state_factor + rng.uniform(least, most)
    search = TpSearch(search.mesh, limit, search.state_factor)
    split, solution = choose_split(ops, search, fixed)
    best = brute_force(tp_graph(ops, search), limit - fixed * search.state_factor)
    assert solution.total_s == pytest.approx(best.total_s, rel=1e-9, abs=1e-12)
    for op in ops:  # tied ops alike
        assert all((op.name in split) == (other in split) for other in op.ties)
    assert solution.memory_bytes + fixed * search.state_factor <= limit * (1 + 1e-7)


def test_pins_are_kept() -> None:
    ops = block(0) + block(1)
    split, _ = choose_split(ops, TpSearch(SLOW, 1e12, 2.0), pins={"up0": "colwise"})
    assert split == {"up0", "down0"}  # the pin's tie splits too
    split, _ = choose_split(ops, TpSearch(FAST, 1e12, 2.0), pins={"down1": "replicate"})
    assert split == {"up0", "down0"}


def test_the_graph_prices_compute_collectives_and_state() -> None:
    [up, down] = block(0)
    graph = tp_graph([up, down], TpSearch(SLOW, 1e9, 3.0))
    whole = evaluate(graph, {"up0": "replicate", "down0": "replicate"})
    split = evaluate(graph, {"up0": "colwise", "down0": "rowwise"})
    assert whole.compute_s == pytest.approx(2 * split.compute_s) == pytest.approx(3 * (up.flops + down.flops) / 5e10)
    ring = 2 * 2 * (2 - 1) * (50e-6 + 4.0 * 16 * 64 / 2 / 2e9)  # an all-reduce of 4 KiB on 2 ranks, twice
    assert split.communication_s == pytest.approx(ring)
    assert whole.memory_bytes == pytest.approx(2 * split.memory_bytes) == pytest.approx(3 * (up.param_bytes + down.param_bytes))
    assert evaluate(graph, {"up0": "colwise", "down0": "replicate"}).total_s == float("inf")


def test_limits_that_cannot_hold_the_stage_name_the_values() -> None:
    ops = block(0)
    with pytest.raises(ConfigError, match=r"memory_limit_bytes=100 per stage does not hold even the 4000 bytes"):
        choose_split(ops, TpSearch(SLOW, 100, 4.0), fixed_bytes=1000)
    least = state(ops, {"up0", "down0"}, 2, 4.0)
    with pytest.raises(ConfigError, match=rf"less than the {least:.6g} bytes .* tp=2; raise Config.memory_limit_bytes"):
        choose_split(ops, TpSearch(SLOW, least * 0.9, 4.0))
    with pytest.raises(ConfigError, match="got no splittable operations"):
        choose_split([], TpSearch(SLOW, 1e9))
    with pytest.raises(ConfigError, match="memory_limit_bytes must be a positive number, got 0"):
        TpSearch(SLOW, 0)
    with pytest.raises(ConfigError, match=r"state_factor must be >= 1 .* got 0.5"):
        TpSearch(SLOW, 1e9, 0.5)
