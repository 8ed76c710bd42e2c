"""Solved partitions shared across settings: which problem is looser, a looser optimum reused only
where it fits and then with the direct solve's T, and the search solving a family once."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

import plait.search.solved as solved_module
from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster, Setting, partition_problem
from plait.cost.problem import PartitionProblem
from plait.search.partition import PartitionResult, solve_partition
from plait.search.search import SearchSpace, search
from plait.search.solved import SolvedPartitions, looser
from tests.plan.factory import layer_costs, random_costs


def problem(rng: random.Random, n: int, stages: int, limit: float) -> PartitionProblem:
    ints = lambda low, high: [float(rng.randint(low, high)) for _ in range(n)]  # noqa: E731
    return PartitionProblem(
        time=ints(1, 9), fill=ints(1, 9), cut_time=ints(0, 3)[: n - 1], bottleneck_count=3.0,
        num_chunks=stages, fixed=ints(0, 20), per_held=ints(0, 10), held=[float(stages - s) for s in range(stages)],
        memory_limit=limit,
    )


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[PartitionProblem]:
    """The problems `SolvedPartitions` hands to `solve_partition`, in order."""
    seen: list[PartitionProblem] = []

    def counted(p: PartitionProblem):  # type: ignore[no-untyped-def]
        seen.append(p)
        return solve_partition(p)

    monkeypatch.setattr(solved_module, "solve_partition", counted)
    return seen


def test_looser_means_every_memory_term_as_small_and_a_limit_as_large() -> None:
    base = problem(random.Random(0), 6, 3, 60.0)
    smaller = replace(base, fixed=[x / 2 for x in base.fixed])
    assert looser(smaller, base) and not looser(base, smaller)
    assert looser(base, base)
    assert not looser(replace(smaller, memory_limit=59.0), base)  # a smaller limit
    assert not looser(replace(smaller, held=[9.0, 1.0, 1.0]), base)  # one stage holds more
    assert not looser(replace(smaller, time=[1.0] * 6), base)  # another objective
    assert not looser(replace(base, fixed=[-1.0] + list(base.fixed[1:])), base)  # negative: no order
    pieces = replace(base, piece_once=[1.0] * 6, piece_entry=[0.0] * 6)
    assert looser(pieces, base)  # the lesser of two forms is no more than the one
    assert not looser(base, pieces)


@pytest.mark.parametrize("seed", range(30))
def test_a_looser_optimum_is_reused_only_where_it_fits_and_gives_the_same_t(seed: int) -> None:
    rng = random.Random(seed)
    n, stages = rng.randint(3, 8), rng.randint(1, 3)
    narrow = problem(rng, n, stages, float(rng.randint(20, 80)))
    wide = replace(narrow, fixed=[x * rng.choice([0.0, 0.5]) for x in narrow.fixed],
                   held=[1.0] * stages, memory_limit=narrow.memory_limit * 2)
    direct = solve_partition(narrow)
    got = SolvedPartitions().solve(narrow, lambda: wide)
    assert type(got) is type(direct)
    if isinstance(direct, PartitionResult):
        assert isinstance(got, PartitionResult)
        assert got.objective == direct.objective and got.max_time == direct.max_time
        assert math.isfinite(narrow.objective(got.layers_per_stage))


def test_the_loosest_is_solved_once_for_a_family(calls: list[PartitionProblem]) -> None:
    base = problem(random.Random(3), 8, 3, math.inf)
    wide = replace(base, fixed=[0.0] * 8)
    shared = SolvedPartitions()
    first = shared.solve(base, lambda: wide)
    assert calls == [wide]  # the loosest solved; its layout fits: base not solved
    again = shared.solve(replace(base, fixed=[x / 2 for x in base.fixed]), lambda: wide)
    assert again == first and calls == [wide]
    assert shared.solve(base) == first and calls == [wide]  # the same problem: found again
    # a limit the loosest layout exceeds: the narrow problem is solved itself
    tight = replace(base, memory_limit=25.0)
    found = shared.solve(tight, lambda: wide)
    assert calls[-1] is tight and found == solve_partition(tight)


def test_the_search_solves_gpipe_and_1f1b_and_the_zero_levels_once(calls: list[PartitionProblem]) -> None:
    costs = layer_costs(6, forward=1.0, backward=2.0, params=10.0, activation=5.0)
    net = Network(Link(0.0, 1e30), Link(0.0, 1e30), 8)
    space = SearchSpace(pp=(2,), num_microbatches=(4,), schedules=("gpipe", "1f1b"), recompute=(False,),
                        batch_weight_grads=(False,), zero=(0, 1, 2), keep=20, simulate_top=0)
    found = search(costs, 4, 8, Cluster(net, math.inf), space)
    assert sorted((c.setting.schedule, c.setting.zero) for c in found) == [
        (schedule, zero) for schedule in ("1f1b", "gpipe") for zero in (0, 1, 2)]
    assert len(calls) == 1  # six settings (2 schedules x 3 levels), one partition
    # where memory binds GPipe but not 1F1B's loosest layout, GPipe is solved itself, and each
    # setting's T is its own direct solve's
    rng = random.Random(0)
    for _ in range(20):
        costs = random_costs(rng, 6)
        limit = float(rng.randint(100, 600))
        for schedule in ("gpipe", "1f1b"):
            for zero in (0, 1, 2):
                setting = Setting(2, 2, 4, schedule, zero=zero)
                p = partition_problem(costs, setting, Cluster(net, limit), 8)
                loose = partition_problem(costs, replace(setting, schedule="1f1b", zero=2), Cluster(net, limit), 8)
                got, direct = SolvedPartitions().solve(p, lambda: loose), solve_partition(p)
                assert type(got) is type(direct)
                if isinstance(direct, PartitionResult):
                    assert isinstance(got, PartitionResult) and got.objective == direct.objective
