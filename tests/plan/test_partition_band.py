"""The banded partition (long models) against the dense tables and brute force, on random costs."""

from __future__ import annotations

import random

import pytest

import plait.plan.partition as partition
from plait.errors import PartitionError
from plait.plan.partition import PartitionProblem, brute_force_partition, least_memory, optimal_partition


def _problem(rng: random.Random, n: int, stages: int) -> PartitionProblem:
    """Runs of identical layers (as a GPT's blocks), integer costs: every sum is exact in floats."""
    layers: list[list[int]] = []
    while len(layers) < n:
        layers += [[rng.randint(1, 9) for _ in range(6)]] * rng.randint(1, max(1, n // 3))
    layers = layers[:n]

    def column(k: int) -> list[float]:
        return [float(v[k]) for v in layers]

    start = rng.randrange(n)
    uncuttable = [(start, min(n - 1, start + rng.randint(1, 3)))] if n > 2 and rng.random() < 0.3 else []
    uncuttable = [(a, b) for a, b in uncuttable if a < b]
    return PartitionProblem(
        time=column(0), fill=column(1), cut_time=[float(rng.choice([1, 2])) for _ in range(n - 1)],
        bottleneck_count=float(rng.choice([0, 1, 3, 7])), num_chunks=stages, fixed=column(2),
        per_held=column(3), held=sorted((float(rng.randint(1, 4)) for _ in range(stages)), reverse=True),
        memory_limit=float(rng.randint(15, 80)), once=column(4) if rng.random() < 0.5 else (),
        entry=column(5) if rng.random() < 0.5 else (), last_fill=column(1) if rng.random() < 0.5 else (),
        uncuttable=uncuttable,
    )


def _solve(problem: PartitionProblem, dense_layers: int, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    monkeypatch.setattr(partition, "DENSE_LAYERS", dense_layers)
    try:
        found: object = optimal_partition(problem)
    except PartitionError as err:
        found = str(err)
    return found, least_memory(problem)


@pytest.mark.parametrize("seed", range(4))
def test_banded_partition_is_the_dense_optimum(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        n = rng.randint(2, 30)
        problem = _problem(rng, n, rng.randint(1, min(n, 7)))
        dense, dense_least = _solve(problem, 10**9, monkeypatch)
        banded, banded_least = _solve(problem, 0, monkeypatch)
        assert banded_least == dense_least
        if isinstance(dense, str):
            assert banded == dense  # the same reason, with the same numbers
            continue
        assert isinstance(banded, partition.PartitionResult)
        assert isinstance(dense, partition.PartitionResult)
        assert banded.objective == dense.objective
        assert problem.objective(banded.layers_per_stage) == banded.objective
        if n <= 12:  # and the true optimum
            brute = brute_force_partition(problem)
            assert brute is not None and brute.objective == banded.objective


def test_a_long_model_of_identical_blocks_is_cut_evenly() -> None:
    """7,502 layers (embedding, 7,500 blocks, head) on 2,500 stages, no (n + 1)^2 table built.
    Below 16 (four blocks) a stage holds at most 3 blocks, the embedding's 3 and the head's 2:
    3 + 2,498 x 3 + 2 = 7,499 blocks, one short; so the slowest stage holds four blocks."""
    n, stages = 7502, 2500
    time = [1.0] + [4.0] * (n - 2) + [6.0]
    problem = PartitionProblem(
        time=time, fill=time, cut_time=[1.0] * (n - 1), bottleneck_count=3.0, num_chunks=stages,
        fixed=[1.0] * n, per_held=[1.0] * n, held=[4.0] * stages, memory_limit=1e9)
    found = optimal_partition(problem)
    assert sum(found.layers_per_stage) == n and len(found.layers_per_stage) == stages
    assert found.max_time == 16.0
    assert found.objective == problem.objective(found.layers_per_stage)
