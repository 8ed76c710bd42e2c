"""Partitioning: the balancer and the step-time partition are exactly optimal (brute force on
random costs); bad splits name the layers; infeasible ones say what does not fit."""

import itertools
import math
import random

import pytest

from plait.cost.recompute_pieces import piece_terms
from plait.errors import PartitionError
from plait.schedule import simulate
from plait.search.partition import (
    PartitionProblem,
    balance,
    brute_force_partition,
    check_partition,
    least_memory,
    optimal_partition,
)


def brute_force(costs, stages, regions):
    best = None
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        if any(a <= c - 1 < b for c in cuts for a, b in regions):
            continue
        worst = max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(stages))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balance_is_optimal_on_random_costs(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    costs = [rng.choice([0.5, 1.0, 2.0, 3.5, 7.0]) for _ in range(n)]
    stages = rng.randint(1, n)
    regions = []
    if n >= 3 and rng.random() < 0.5:
        a = rng.randint(0, n - 2)
        regions = [(a, rng.randint(a + 1, n - 1))]
    want = brute_force(costs, stages, regions)
    if want is None:
        with pytest.raises(PartitionError, match="uncuttable"):
            balance(costs, stages, regions)
        return
    sizes = balance(costs, stages, regions)
    assert sum(sizes) == n and len(sizes) == stages and min(sizes) >= 1
    bounds = [0, *itertools.accumulate(sizes)]
    got = max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(stages))
    assert got == want
    check_partition(sizes, [f"l{i}" for i in range(n)], regions)  # the result is itself valid


def test_balance_equal_costs_split_evenly():
    assert balance([1.0] * 8, 2) == [4, 4]
    assert balance([1.0] * 8, 4) == [2, 2, 2, 2]


def test_wrong_sum_lists_the_layers():
    with pytest.raises(PartitionError) as info:
        check_partition([2, 2], ["fc1", "relu", "fc2"])
    message = str(info.value)
    assert "sums to 4" in message and "3 layers" in message and "0:fc1, 1:relu, 2:fc2" in message


def test_more_stages_than_layers():
    with pytest.raises(PartitionError, match="only 2 layers"):
        check_partition([1, 1, 1], ["a", "b"])
    with pytest.raises(PartitionError, match="use between 1 and 2"):
        balance([1.0, 1.0], 3)


def test_cut_inside_uncuttable_region_names_the_layers():
    with pytest.raises(PartitionError) as info:
        check_partition([1, 3], ["a", "b", "a#1", "c"], [(0, 2)])
    message = str(info.value)
    assert "a, b, a#1" in message and "before layer 0 or after layer 2" in message


# -- the exact partition for a step time --------------------------------------------------------

def random_problem(rng: random.Random) -> PartitionProblem:
    n = rng.randint(1, 8)
    stages = rng.randint(1, n)

    def ints(k, low, high):
        return [rng.randint(low, high) for _ in range(k)]

    regions = []
    if n >= 3 and rng.random() < 0.3:
        a = rng.randint(0, n - 2)
        regions = [(a, rng.randint(a + 1, n - 1))]
    recompute = rng.random() < 0.3
    once, entry = (ints(n, 0, 3), ints(n, 0, 2)) if recompute else ((), ())
    piece_entry, piece_once = piece_terms(random_blocks(rng, n), once, entry) if recompute and rng.random() < 0.8 else ((), ())
    return PartitionProblem(
        time=ints(n, 1, 9), fill=ints(n, 0, 9), cut_time=ints(n - 1, 0, 3),
        bottleneck_count=rng.randint(0, 9), num_chunks=stages,
        fixed=ints(n, 0, 5), per_held=ints(n, 0, 3), held=sorted(ints(stages, 1, 4), reverse=True),
        memory_limit=rng.choice([math.inf, 10, 15, 25]), once=once, entry=entry,
        last_fill=ints(n, 0, 3) if rng.random() < 0.3 else (), uncuttable=regions,
        piece_once=piece_once, piece_entry=piece_entry,
    )


def random_blocks(rng: random.Random, n: int) -> list[str]:
    """Layer names in runs of one repeated block ('h.3.x') or alone ('head'): recomputation's pieces."""
    names, block = [], 0
    while len(names) < n:
        size = rng.randint(1, 3)
        names += [f"h.{block}.{i}" for i in range(size)] if rng.random() < 0.7 else [f"layer{block}"]
        block += 1
    return names[:n]


@pytest.mark.parametrize("seed", range(300))
def test_optimal_partition_equals_brute_force(seed):
    # integer costs: the optimum is exact, no tolerance; memory limits and uncuttable regions
    # make some instances infeasible, and then both must agree on that too; recomputed stages
    # priced whole or, where given the pieces, the lesser of whole and piece by piece
    problem = random_problem(random.Random(seed))
    want = brute_force_partition(problem)
    if want is None:
        with pytest.raises(PartitionError):
            optimal_partition(problem)
        return
    got = optimal_partition(problem)
    assert got.objective == want.objective
    assert problem.objective(got.layers_per_stage) == got.objective  # it reports its own layout
    assert len(got.layers_per_stage) == problem.num_chunks and min(got.layers_per_stage) >= 1
    check_partition(got.layers_per_stage, [f"l{i}" for i in range(len(problem.time))],
                    problem.uncuttable)


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_objective_is_simulates_step_time_for_uniform_stages(p, m, schedule):
    # Alpa's T = sum t + (m - 1) max t (Zheng et al. 2022) with t = t_f + t_b is Megatron's
    # (m + p - 1)(t_f + t_b) (Narayanan et al. 2021) with one layer per stage, every layer the same
    t_f, t_b = 2, 3
    problem = PartitionProblem(time=[t_f + t_b] * p, fill=[t_f + t_b] * p, cut_time=[0] * (p - 1),
                               bottleneck_count=m - 1, num_chunks=p, fixed=[0] * p,
                               per_held=[0] * p, held=[1] * p)
    best = optimal_partition(problem)
    assert best.layers_per_stage == (1,) * p
    assert best.objective == simulate(schedule, p, m, t_f, t_b).step_time


def test_many_microbatches_balance_the_slowest_stage():
    # with a large count the bottleneck dominates: the optimum's max is balance's min-max
    costs = [4, 1, 1, 3, 2, 2, 5, 1]
    problem = PartitionProblem(time=costs, fill=costs, cut_time=[0] * 7, bottleneck_count=1000,
                               num_chunks=3, fixed=[0] * 8, per_held=[0] * 8, held=[1] * 3)
    sizes = balance(costs, 3)
    bounds = [0, *itertools.accumulate(sizes)]
    assert optimal_partition(problem).max_time == max(
        sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_memory_moves_layers_off_the_stage_holding_most_microbatches():
    # 1F1B: stage 0 holds 2 micro-batches, stage 1 one; activations of 4 bytes per layer and
    # micro-batch, limit 12: stage 0 fits one layer (8), stage 1 three (12)
    problem = PartitionProblem(time=[1] * 4, fill=[1] * 4, cut_time=[0] * 3, bottleneck_count=9,
                               num_chunks=2, fixed=[0] * 4, per_held=[4] * 4, held=[2, 1],
                               memory_limit=12)
    assert optimal_partition(problem).layers_per_stage == (1, 3)
    assert least_memory(problem) == 12


def test_a_layer_too_large_for_any_device_needs_tensor_parallelism():
    gib = 2**30
    problem = PartitionProblem(time=[1, 1], fill=[1, 1], cut_time=[0], bottleneck_count=1,
                               num_chunks=2, fixed=[3 * gib, gib], per_held=[0, 0], held=[2, 1],
                               memory_limit=2 * gib, names=["wte", "head"])
    with pytest.raises(PartitionError) as info:
        optimal_partition(problem)
    message = str(info.value)
    assert "layer 0 (wte) alone needs 3.00 GiB" in message and "tensor parallelism" in message


def test_uncuttable_region_leaves_no_layout():
    problem = PartitionProblem(time=[1, 1, 1], fill=[1, 1, 1], cut_time=[0, 0],
                               bottleneck_count=1, num_chunks=2, fixed=[0] * 3, per_held=[0] * 3,
                               held=[1, 1], uncuttable=[(0, 2)])
    with pytest.raises(PartitionError, match="uncuttable region"):
        optimal_partition(problem)


def test_arrays_of_the_wrong_length():
    with pytest.raises(PartitionError, match="wrong length"):
        PartitionProblem(time=[1, 1], fill=[1], cut_time=[0], bottleneck_count=1, num_chunks=1,
                         fixed=[0, 0], per_held=[0, 0], held=[1])


def test_a_stage_of_many_layers_fits_recomputed_layer_by_layer():
    # one stage of 6 layers, 2 micro-batches held: recomputed whole it holds 2 inputs (2 x 1) and
    # every layer's activations of one micro-batch (6 x 4 = 24); layer by layer, 2 x 6 inputs and
    # one layer's 4. A limit of 20 admits only the second.
    n = 6
    once, entry = [4.0] * n, [1.0] * n
    piece_entry, piece_once = piece_terms([f"h.{i}" for i in range(n)], once, entry)
    common = dict(time=[1.0] * n, fill=[1.0] * n, cut_time=[0.0] * (n - 1), bottleneck_count=1.0, num_chunks=1,
                  fixed=[0.0] * n, per_held=[0.0] * n, held=[2.0], memory_limit=20.0, once=once, entry=entry)
    whole = PartitionProblem(**common)
    assert whole.memory(0, 0, n) == 2 * 1 + 24
    with pytest.raises(PartitionError):
        optimal_partition(whole)
    layered = PartitionProblem(**common, piece_once=piece_once, piece_entry=piece_entry)
    assert layered.memory(0, 0, n) == 2 * 6 + 4 and layered.by_pieces(0, 0, n)
    assert optimal_partition(layered).layers_per_stage == (n,)
    # pieces of two layers each (blocks 'h.k.a', 'h.k.b'): 3 inputs kept, a piece of 8 recomputed
    piece_entry, piece_once = piece_terms([f"h.{i // 2}.{'ab'[i % 2]}" for i in range(n)], once, entry)
    blocks = PartitionProblem(**common, piece_once=piece_once, piece_entry=piece_entry)
    assert blocks.memory(0, 0, n) == 2 * 3 + 8
    # one layer alone: both ways hold the same, and whole is kept
    assert not layered.by_pieces(0, 0, 1) and layered.memory(0, 0, 1) == whole.memory(0, 0, 1)

