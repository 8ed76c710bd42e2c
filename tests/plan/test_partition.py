"""Partitioning: the balancer is exactly optimal (brute force on random costs); bad splits name the layers."""

import itertools
import random

import pytest

from plait.errors import PartitionError
from plait.plan import balance, check_partition


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
