"""Tests for plait.search.submesh: Alpa's inter-operator pass over (layer range, tp width) pairs,
against every cut and width assignment on random instances, and by hand."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from plait.cost.recompute_pieces import piece_terms
from plait.errors import PartitionError
from plait.search.submesh import WidthCosts, brute_force_widths, width_partition


def _costs(rng: random.Random, n: int, widths: tuple[int, ...], recomputed: bool = False,
           by_layer: bool = False) -> dict[int, WidthCosts]:
    base = [float(rng.randint(1, 9)) for _ in range(n)]
    state = [float(rng.randint(0, 20)) for _ in range(n)]
    act = [float(rng.randint(0, 6)) for _ in range(n)]
    entry = [float(rng.randint(0, 3)) for _ in range(n)]
    out = {}
    for w in widths:  # wider: each layer's work split with a random efficiency, its memory split
        speed = [w * rng.uniform(0.4, 1.0) for _ in range(n)]
        time = [b / s for b, s in zip(base, speed)]
        if recomputed:  # each held micro-batch keeps its stage's input; one is recomputed at a time
            once = [a / w for a in act]  # or (by_layer) each layer's input, one layer at a time
            piece_entry, piece_once = piece_terms([f"l{i}" for i in range(n)], once, entry) if by_layer else ((), ())
            out[w] = WidthCosts(time, time, [x / w for x in state], [0.0] * n, once, entry, piece_once, piece_entry)
        else:
            out[w] = WidthCosts(time, time, [x / w for x in state], [a / w for a in act])
    return out


@pytest.mark.parametrize("seed", range(60))
def test_the_program_is_the_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n, devices = rng.randint(1, 6), rng.randint(1, 6)
    widths = tuple(sorted(rng.sample([1, 2, 3, 4], rng.randint(1, 3))))
    costs = _costs(rng, n, widths, recomputed=seed % 3 != 1, by_layer=seed % 3 == 2)
    cuts = [float(rng.randint(0, 3)) for _ in range(n - 1)]
    m, gpipe = rng.randint(1, 6), rng.random() < 0.3
    limit = rng.choice([math.inf, 30.0, 15.0])
    # half the instances: a hand-over between two widths costs its own (a crossing), per direction
    cross = {(a, b): [float(rng.randint(0, 6)) for _ in range(n - 1)] for a in widths for b in widths
             if a != b} if seed % 2 else None
    want = brute_force_widths(costs, cuts, devices, m, gpipe, limit, cross)
    if want is None:
        with pytest.raises(PartitionError, match="no cut of"):
            width_partition(costs, cuts, devices, m, gpipe, limit, cross=cross)
        return
    got = width_partition(costs, cuts, devices, m, gpipe, limit, cross=cross)
    assert got.objective == pytest.approx(want.objective)
    bounds = [0, *itertools.accumulate(got.layers_per_stage)]
    for s, w in enumerate(got.widths):  # every stage of the answer fits
        held = m if gpipe else min(len(got.widths) - s, m)
        assert costs[w].memory(bounds[s], bounds[s + 1], held) <= limit
    assert sum(got.widths) == devices and sum(got.layers_per_stage) == n


def test_a_dear_crossing_keeps_one_width_by_hand() -> None:
    # the heavy layer would take a wide stage (see below), but changing width costs 100 a hand-over
    costs = {1: WidthCosts([12, 1, 1], [12, 1, 1], [0, 0, 0], [0, 0, 0]),
             2: WidthCosts([6, 1, 1], [6, 1, 1], [0, 0, 0], [0, 0, 0])}
    dear = {(1, 2): [100.0, 100.0], (2, 1): [100.0, 100.0]}
    got = width_partition(costs, [0.0, 0.0], 3, 4, cross=dear)
    assert got.widths == (1, 1, 1) and got.objective == pytest.approx(12 + 1 + 1 + 3 * 12)


def test_a_heavy_layer_gets_the_wide_stage_by_hand() -> None:
    # 3 layers: a heavy first (12 on 1 rank, 6 on 2) and two light (1 each, not split well: 1 on 2)
    costs = {1: WidthCosts([12, 1, 1], [12, 1, 1], [0, 0, 0], [0, 0, 0]),
             2: WidthCosts([6, 1, 1], [6, 1, 1], [0, 0, 0], [0, 0, 0])}
    got = width_partition(costs, [0.0, 0.0], 3, 4)
    # stage 0 = the heavy layer on 2 ranks (6), stage 1 = the rest on 1 (2): 6 + 2 + 3 x 6 = 26
    assert (got.layers_per_stage, got.widths, got.objective) == ((1, 2), (2, 1), 26.0)
    uniform = width_partition({1: costs[1]}, [0.0, 0.0], 3, 4)  # 3 stages of 1: 14 + 3 x 12 = 50
    assert uniform.objective == 50.0 and uniform.widths == (1, 1, 1)


def test_a_layout_the_state_alone_cannot_fit_is_refused_before_any_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 layers of 10 bytes of state each on 1 rank, 6 each on 2 (12 rank-bytes): at the least 20
    # over the devices; 2 devices of 9 bytes hold 18, so nothing fits, and no table is built
    from plait.search import submesh

    costs = {1: WidthCosts([1.0, 1.0], [1.0, 1.0], [10.0, 10.0], [0.0, 0.0]),
             2: WidthCosts([1.0, 1.0], [1.0, 1.0], [6.0, 6.0], [0.0, 0.0])}
    assert brute_force_widths(costs, [0.0], 2, 4, memory_limit=9.0) is None
    monkeypatch.setattr(submesh._Tables, "best_under", lambda *a: pytest.fail("a table was built"))
    with pytest.raises(PartitionError, match=r"state alone need 20 bytes .* 10 per device; allow more devices"):
        width_partition(costs, [0.0], 2, 4, memory_limit=9.0)


@pytest.mark.parametrize("seed", range(20))
def test_long_stages_are_the_brute_force(seed: int) -> None:
    # stages of up to all 9 layers (the program runs over a band of stage lengths: the longest
    # that fits), and stages of at most 2 where memory allows no more
    rng = random.Random(100 + seed)
    n, devices = 9, rng.randint(2, 5)
    costs = _costs(rng, n, (1, 2), recomputed=seed % 2 == 1)
    cuts = [float(rng.randint(0, 3)) for _ in range(n - 1)]
    limit = math.inf if seed < 10 else max(c.memory(k, min(k + 2, n), 3) for c in costs.values() for k in range(n))
    want = brute_force_widths(costs, cuts, devices, 3, False, limit)
    if want is None:
        with pytest.raises(PartitionError, match="no cut of"):
            width_partition(costs, cuts, devices, 3, memory_limit=limit)
        return
    assert width_partition(costs, cuts, devices, 3, memory_limit=limit).objective == pytest.approx(want.objective)


def test_bad_input_is_named() -> None:
    with pytest.raises(PartitionError, match="needs widths"):
        width_partition({}, [], 2, 4)
    with pytest.raises(PartitionError, match="per-layer values"):
        width_partition({1: WidthCosts([1.0, 1.0], [1.0, 1.0], [0, 0], [0, 0])}, [], 2, 4)


def test_recomputation_holds_each_micro_batch_s_input_and_one_micro_batch() -> None:
    plain = WidthCosts([1.0, 1.0], [1.0, 1.0], [2.0, 3.0], [5.0, 7.0])
    recomputed = WidthCosts([1.0, 1.0], [1.0, 1.0], [2.0, 3.0], [0.0, 0.0], [5.0, 7.0], [1.0, 4.0])
    assert plain.memory(0, 2, 3) == 2 + 3 + 3 * (5 + 7)
    assert recomputed.memory(0, 2, 3) == 2 + 3 + (5 + 7) + 3 * 1.0
    assert recomputed.memory(1, 2, 3) == 3 + 7 + 3 * 4.0
    # a limit only recomputation meets: two layers on one device, GPipe holding four micro-batches
    with pytest.raises(PartitionError):
        width_partition({1: plain}, [0.0], 1, 4, gpipe=True, memory_limit=25.0)
    assert width_partition({1: recomputed}, [0.0], 1, 4, gpipe=True, memory_limit=25.0).layers_per_stage == (2,)
    # layer by layer: both layers' inputs kept, the larger layer recomputed -- less at one held
    piece_entry, piece_once = piece_terms(["a", "b"], [5.0, 7.0], [1.0, 4.0])
    layered = WidthCosts([1.0, 1.0], [1.0, 1.0], [2.0, 3.0], [0.0, 0.0], [5.0, 7.0], [1.0, 4.0], piece_once, piece_entry)
    assert layered.memory(0, 2, 1) == 2 + 3 + 7 + 1 * (1.0 + 4.0) < recomputed.memory(0, 2, 1)
    assert layered.memory(0, 2, 4) == recomputed.memory(0, 2, 4)  # more held: whole is less
    with pytest.raises(PartitionError):
        width_partition({1: recomputed}, [0.0], 1, 1, memory_limit=17.0)
    assert width_partition({1: layered}, [0.0], 1, 1, memory_limit=17.0).layers_per_stage == (2,)


@pytest.mark.parametrize("seed", range(4))
def test_many_bottlenecks_are_tried_in_buckets_within_one_percent(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.search import submesh

    rng = random.Random(100 + seed)
    n, devices, widths = 8, 5, (1, 2, 3)
    costs = _costs(rng, n, widths)
    cuts = [float(rng.randint(0, 3)) for _ in range(n - 1)]
    candidates = {sum(c.time[k:i]) for c in costs.values() for k in range(n) for i in range(k + 1, n + 1)}
    assert len(candidates) > submesh.EXACT  # thinned
    want = brute_force_widths(costs, cuts, devices, 8)
    assert want is not None
    got = width_partition(costs, cuts, devices, 8)
    assert want.objective - 1e-9 <= got.objective <= want.objective * (1 + submesh.THIN)
    monkeypatch.setattr(submesh, "EXACT", 10**9)  # every candidate: the optimum itself
    assert width_partition(costs, cuts, devices, 8).objective == pytest.approx(want.objective)
