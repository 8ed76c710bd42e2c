"""The banded partition (long models) against the dense tables and brute force, on random costs."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

import plait.search.partition as partition
import plait.search.partition_band as partition_band
from plait.cost.recompute_pieces import piece_terms
from plait.errors import PartitionError
from plait.search.partition import (
    PartitionProblem,
    PartitionResult,
    brute_force_partition,
    least_memory,
    optimal_partition,
)
from plait.search.partition_band import BandedTables


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
        uncuttable=uncuttable, **_pieces(rng, n, column(4), column(5)),
    )


def _pieces(rng: random.Random, n: int, once: list[float], entry: list[float]) -> dict[str, list[float]]:
    """Half the time, recomputation piece by piece too: pieces of 1-3 layers."""
    if rng.random() < 0.5:
        return {}
    names, block = [], 0
    while len(names) < n:
        names += [f"h.{block}.{i}" for i in range(rng.randint(1, 3))]
        block += 1
    piece_entry, piece_once = piece_terms(names[:n], once, entry)
    return {"piece_once": piece_once, "piece_entry": piece_entry}


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


# -- the min-max program's bound, the scan's passes, the blocks: each against the plain program --

def _float_problem(rng: random.Random, n: int, stages: int) -> PartitionProblem:
    """Runs of identical layers with float costs: equal ranges in different places round to
    times a few ulps apart, the near-ties the scan over t_max walks through one by one."""
    kinds = [[rng.choice([0.1, 0.3, 0.7, 1.1]) * rng.randint(1, 4) for _ in range(6)] for _ in range(3)]
    layers: list[list[float]] = []
    while len(layers) < n:
        layers += [rng.choice(kinds)] * rng.randint(1, max(1, n // 2))
    layers = layers[:n]

    def column(k: int) -> list[float]:
        return [v[k] for v in layers]

    return PartitionProblem(
        time=column(0), fill=column(1), cut_time=[0.05 * rng.randint(1, 3)] * (n - 1),
        bottleneck_count=float(rng.choice([0, 1, 3, 7, 31])), num_chunks=stages, fixed=column(2),
        per_held=column(3), held=sorted((float(rng.randint(1, 4)) for _ in range(stages)), reverse=True),
        memory_limit=rng.uniform(3.0, 40.0), once=column(4) if rng.random() < 0.5 else (),
        entry=column(5) if rng.random() < 0.5 else (), last_fill=column(1) if rng.random() < 0.3 else (),
        **_pieces(rng, n, column(4), column(5)),
    )


def _stepwise(problem: PartitionProblem) -> PartitionResult | None:
    """The banded scan without its passes: every range time from the least slowest stage up, one
    program each (the start from the min-max program over every range, no greedy bound)."""
    tables = BandedTables(problem)
    count = problem.bottleneck_count
    unbounded = tables._sweep(math.inf, problem.memory_limit, "max")
    lowest = unbounded[0] if unbounded is not None and count > 0 else math.inf
    found = tables.run(lowest) if math.isfinite(lowest) or count <= 0 else None
    if found is None:
        return None

    def result(value: float, sizes: list[int]) -> PartitionResult:
        worst = tables.slowest(sizes)
        return PartitionResult(tuple(sizes), value + count * worst, worst)

    best = result(*found)
    if count <= 0:
        return best
    cuts = np.sort(tables.cut[1:-1][tables.allowed[1:-1]])[: problem.num_chunks - 1]
    floor = float(tables.fp[-1]) * (1 - 1e-9) + float(cuts.sum()) * (1 - 1e-9)
    t = tables.next_time(lowest)
    while t is not None and floor + count * t < best.objective:
        step = tables.run(t)
        if step is not None and result(*step).objective < best.objective:
            best = result(*step)
        t = tables.next_time(t)
    return best


def _every_layout(tables: BandedTables) -> tuple[float, float]:
    """(least memory, least slowest stage of a layout that fits) over every composition, each
    range priced with the banded tables' own float operations (the dense ones round otherwise)."""
    n, stages, p = tables.n, tables.p.num_chunks, tables.p
    least, fastest = math.inf, math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        if not all(tables.allowed[b] for b in bounds):
            continue
        ranges = list(zip(bounds, bounds[1:]))
        memory = max(min(float(tables.rise[h][i] - tables.drop[h][j]),
                         tables.by_pieces(h, j, i) if tables.pieces else math.inf) for h, (j, i) in zip(p.held, ranges))
        least = min(least, memory)
        if memory <= p.memory_limit:
            fastest = min(fastest, max(tables.range_time(j, i) for j, i in ranges))
    return least, fastest


@pytest.mark.parametrize("seed", range(3))
def test_min_max_time_and_least_memory_are_every_layouts(seed: int) -> None:
    # the min-max program runs once, within a greedy layout's slowest stage (or the least-memory
    # layout's); the least memory on the band narrowed by memory: both exact, and the dense
    # tables' where the sums are exact (integer costs)
    rng = random.Random(seed)
    for _ in range(80):
        n = rng.randint(2, 13)
        stages = rng.randint(1, min(n, 6))
        exact = rng.random() < 0.5
        problem = _problem(rng, n, stages) if exact else _float_problem(rng, n, stages)
        banded = BandedTables(problem)
        got = (banded.least_memory(), banded.min_max_time())
        assert got == _every_layout(banded)
        if exact:
            dense = partition._Tables(problem)
            assert got == (dense.least_memory(), dense.min_max_time())


def test_a_greedy_that_misses_the_only_layout_still_finds_the_least_slowest_stage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The greedy gives stage 0 layers 0-2 (3 of 3.5 bytes), leaving layer 3 whose entry bytes
    # (10) fit no stage; 2 + 2 fits (slowest 6: layers 2-3) and 1 + 3 (slowest 7), the greedy
    # neither: the bound is the least-memory layout's.
    problem = PartitionProblem(time=[1.0, 1.0, 1.0, 5.0], fill=[1.0] * 4, cut_time=[0.0] * 3,
                               bottleneck_count=3.0, num_chunks=2, fixed=[1.0] * 4, per_held=[0.0] * 4,
                               held=[1.0, 1.0], memory_limit=3.5, entry=[0.0, 0.0, 0.0, 10.0])
    tables = BandedTables(problem)
    assert tables._greedy(math.inf) is None and tables._greedy_bound() is None
    assert tables.min_max_time() == 6.0
    monkeypatch.setattr(partition, "DENSE_LAYERS", 0)
    assert optimal_partition(problem).layers_per_stage == (2, 2)


@pytest.mark.parametrize("seed", range(3))
def test_the_scans_passes_keep_the_stepwise_scans_layout(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass runs one program at the scan's end and skips every t_max before it where no layout
    # can beat the best: the layout and T must be the step-by-step scan's to the last bit, ties
    # and rounding included (float costs, repeated blocks).
    monkeypatch.setattr(partition, "DENSE_LAYERS", 0)
    rng = random.Random(seed)
    for _ in range(60):
        n = rng.randint(4, 40)
        problem = _float_problem(rng, n, rng.randint(1, min(n, 9)))
        want = _stepwise(problem)
        found = partition.solve_partition(problem)
        if want is None:
            assert isinstance(found, partition.Infeasible)
            continue
        assert isinstance(found, PartitionResult)
        assert (found.layers_per_stage, found.objective, found.max_time) == (
            want.layers_per_stage, want.objective, want.max_time)


@pytest.mark.parametrize("seed", range(2))
def test_programs_in_small_blocks_equal_one_block(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Wide windows are priced a few rows at a time (terms built per stage, blocks merged with
    # the earlier start winning ties): the same values and choices as one block.
    rng = random.Random(seed)
    problems = []
    for _ in range(40):
        n = rng.randint(2, 30)
        stages = rng.randint(1, min(n, 7))
        problems.append(_problem(rng, n, stages) if rng.random() < 0.5 else _float_problem(rng, n, stages))
    monkeypatch.setattr(partition, "DENSE_LAYERS", 0)
    whole = [partition.solve_partition(p) for p in problems]
    monkeypatch.setattr(partition_band, "_WHOLE", 0)
    monkeypatch.setattr(partition_band, "_BLOCK", 7)
    assert [partition.solve_partition(p) for p in problems] == whole


def test_an_infeasible_problem_carries_its_least_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # The search reports how much memory the closest setting needs: the infeasible result carries
    # it (no tables kept between calls), the figure least_memory gives, the reason the error's.
    rng = random.Random(7)
    seen = 0
    for dense_layers in (10**9, 0):
        monkeypatch.setattr(partition, "DENSE_LAYERS", dense_layers)
        for _ in range(60):
            n = rng.randint(2, 20)
            problem = _problem(rng, n, rng.randint(1, min(n, 7)))
            found = partition.solve_partition(problem)
            if not isinstance(found, partition.Infeasible):
                continue
            seen += 1
            assert found.least_memory == least_memory(problem)
            with pytest.raises(PartitionError) as info:
                optimal_partition(problem)
            assert str(info.value) == found.reason
    assert seen >= 10
    assert not [name for name, value in vars(partition).items()
                if isinstance(value, (list, dict, set)) and not name.startswith("__")]
