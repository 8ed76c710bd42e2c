"""Tests for plait.search.width_search: one pipeline whose stages take different tp widths, priced
from the tp pass's per-layer costs, against uniform widths and by hand."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from plait.cost.network import Link, Network, all_reduce
from plait.cost.prediction import CLOSING_BYTES, Cluster
from plait.cost.tp_costs import TpShares
from plait.plan.layer_costs import LayerCosts
from plait.search.width_search import search_widths

FREE = Network(Link(0.0, 1e30), Link(0.0, 1e30), 8)


def _costs(forward: tuple[float, ...]) -> LayerCosts:
    n = len(forward)
    zeros = (0.0,) * n
    return LayerCosts(tuple(f"l{i}" for i in range(n)), zeros, forward, zeros, tuple(2 * f for f in forward),
                      zeros, zeros, zeros, zeros, zeros, zeros, zeros)


def _shares(n: int, tp: int, share: tuple[float, ...]) -> TpShares:
    zeros = (0.0,) * n
    return TpShares(tp, (1.0,) * n, share, zeros, zeros, zeros, zeros, zeros)


def test_a_heavy_layer_that_splits_gets_the_wide_stage() -> None:
    # one row per micro-batch: layer 0 takes 12 a row (F 4 + B 8) and splits whole over tp; layers
    # 1 and 2 take 3 each and do not split. On 3 devices: layer 0 on 2 ranks (6), the rest on 1 (6)
    costs = _costs((4.0, 1.0, 1.0))
    shares = {2: _shares(3, 2, (1.0, 0.0, 0.0))}
    found = search_widths(costs, shares, 3, 4, Cluster(FREE, math.inf), (1, 2), microbatches=(4,))
    assert found is not None
    assert (found.layers_per_stage, found.widths, found.num_microbatches) == ((1, 2), (2, 1), 4)
    assert found.pipeline_s == pytest.approx(6 + 6 + 3 * 6)  # fills + (m - 1) x the bottleneck
    assert found.to_dict()["tp"] == [2, 1]


def test_nothing_when_one_width_applies_or_uniform_wins() -> None:
    costs = _costs((4.0, 1.0, 1.0))
    assert search_widths(costs, {}, 3, 4, Cluster(FREE, math.inf), (1, 2)) is None  # tp=2 not priced
    even = {2: _shares(3, 2, (1.0, 1.0, 1.0))}  # everything splits evenly: 2 x tp=2 beats any mix
    assert search_widths(costs, even, 4, 4, Cluster(FREE, math.inf), (1, 2), microbatches=(4,)) is None


def test_recomputation_where_only_it_fits() -> None:
    # layer 0 keeps 200 bytes a row for its backward (100 on each of 2 ranks), the others 1; the
    # first stage of a 1F1B pipeline holds two micro-batches (200 bytes at tp=2): over a 150-byte
    # limit unless it recomputes (then it keeps its input, 0 bytes, and one micro-batch's 100)
    n = 3
    zeros = (0.0,) * n
    costs = LayerCosts(tuple(f"l{i}" for i in range(n)), zeros, (4.0, 1.0, 1.0), zeros, (8.0, 2.0, 2.0), zeros,
                       zeros, (200.0, 1.0, 1.0), (1.0,) * n, zeros, zeros, zeros)
    shares = {2: _shares(3, 2, (1.0, 0.0, 0.0))}
    tight = Cluster(FREE, 150.0)
    found = search_widths(costs, shares, 3, 4, tight, (1, 2), microbatches=(4,))
    assert found is not None and found.recompute and found.to_dict()["recompute"] is True
    assert sorted(found.widths) == [1, 2]
    assert search_widths(costs, shares, 3, 4, tight, (1, 2), microbatches=(4,), recompute=(False,)) is None
    roomy = search_widths(costs, shares, 3, 4, Cluster(FREE, math.inf), (1, 2), microbatches=(4,))
    assert roomy is not None and not roomy.recompute  # recomputing costs a forward: not where all fits


@pytest.mark.parametrize("gather_latency, crossing, crossing_s", [
    # a gather on the stage's own link is cheap: tiles (forward 2 tiles of V/2 into the tp=1 rank;
    # back, 2 tiles of V/2 out of it and a 2-rank all-gather of V/2 on the fast link)
    (0.0, "tiles", 2 * 0.5e-3 + 2 * 0.5e-3 + 1e6 / 2 / 1e12),
    # the gather costs a second: every rank gets the whole value (back: V to each of 2 ranks)
    (1.0, "whole", 2 * 0.5e-3 + 2 * 1e-3),
])
def test_the_crossing_is_priced_and_the_cheaper_way_chosen(gather_latency: float, crossing: str,
                                                            crossing_s: float) -> None:
    from dataclasses import replace

    costs = replace(_costs((4.0, 1.0, 1.0)), output_row_bytes=(1e6, 1e6, 1e6))  # V = 1 MB a micro-batch
    network = Network(Link(0.0, 1e9), Link(0.0, 1e9), 8, reduce_intra=Link(gather_latency, 1e12))
    shares = {2: _shares(3, 2, (1.0, 0.0, 0.0))}
    found = search_widths(costs, shares, 3, 4, Cluster(network, math.inf), (1, 2), microbatches=(4,))
    assert found is not None and found.widths == (2, 1) and found.crossing == crossing
    assert found.pipeline_s == pytest.approx(6 + 6 + 3 * 6 + crossing_s)
    assert found.to_dict()["crossing"] == crossing


def test_no_cut_inside_an_uncuttable_region_and_only_the_schedules_asked() -> None:
    from dataclasses import replace

    shares = {2: _shares(3, 2, (1.0, 0.0, 0.0))}
    free = Cluster(FREE, math.inf)
    whole = replace(_costs((4.0, 1.0, 1.0)), uncuttable=((0, 1),))  # no cut after layer 0
    found = search_widths(whole, shares, 3, 4, free, (1, 2), microbatches=(4,))
    assert found is not None and found.layers_per_stage[0] >= 2, found  # the best cut (after layer 0) is barred
    gpipe = search_widths(_costs((4.0, 1.0, 1.0)), shares, 3, 4, free, (1, 2), microbatches=(4,), schedules=("gpipe",))
    assert gpipe is not None and gpipe.schedule == "gpipe"


def _random_costs(rng: random.Random, param_bytes: tuple[float, float]) -> tuple[LayerCosts, dict[int, Any]]:
    """3-6 layers of random times and bytes (parameters in `param_bytes`), and random tp=2 shares."""
    n = rng.randint(3, 6)
    zeros = (0.0,) * n
    forward = tuple(rng.uniform(0.5, 4.0) for _ in range(n))
    costs = LayerCosts(tuple(f"l{i}" for i in range(n)), tuple(rng.uniform(0, 1) for _ in range(n)), forward,
                       zeros, tuple(2 * f for f in forward), zeros, zeros, tuple(rng.uniform(0, 4) for _ in range(n)),
                       tuple(rng.uniform(*param_bytes) for _ in range(n)), zeros, zeros,
                       tuple(rng.uniform(0, 2) for _ in range(n)))
    return costs, {2: _shares(n, 2, tuple(rng.choice([0.0, 0.5, 1.0]) for _ in range(n)))}


@pytest.mark.parametrize("seed", range(6))
def test_the_floors_prune_nothing_that_wins(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from plait.search import width_search

    rng = random.Random(seed)
    costs, shares = _random_costs(rng, param_bytes=(0, 1e6))
    cluster = Cluster(Network(Link(1e-4, 1e9), Link(1e-3, 1e8), 2), rng.choice([math.inf, 40.0]))
    pruned = search_widths(costs, shares, 3, 8, cluster, (1, 2))
    monkeypatch.setattr(width_search, "_floor", lambda *args: -math.inf)  # every case partitioned
    every = search_widths(costs, shares, 3, 8, cluster, (1, 2))
    assert pruned == every


@pytest.mark.parametrize("seed", range(8))
def test_cases_that_fit_nothing_are_skipped_only_where_nothing_fits(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # a memory limit under which some micro-batch counts, schedules and recomputations fit nothing:
    # a case whose twin (the other crossing, or 1F1B for GPipe) fit nothing is skipped; every case
    # partitioned (no floor, no skipping) finds the same, GPipe tried first or second
    import random

    from plait.search import width_search

    rng = random.Random(seed)
    costs, shares = _random_costs(rng, param_bytes=(1, 4))
    cluster = Cluster(Network(Link(1e-4, 1e9), Link(1e-3, 1e8), 2), rng.uniform(8.0, 20.0))
    calls: list[int] = []
    real = width_search.width_partition

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(width_search, "width_partition", counted)
    schedules = ("gpipe", "1f1b") if seed % 2 else ("1f1b", "gpipe")
    skipping = search_widths(costs, shares, 3, 8, cluster, (1, 2), schedules=schedules)
    skipped = len(calls)
    monkeypatch.setattr(width_search, "_floor", lambda *args: -math.inf)
    monkeypatch.setattr(width_search, "_fit_key", lambda *args: object())  # no two cases alike
    calls.clear()
    assert search_widths(costs, shares, 3, 8, cluster, (1, 2), schedules=schedules) == skipping
    assert skipped < len(calls)


def _with_grads(grad: float) -> LayerCosts:
    costs = _costs((4.0, 1.0, 1.0))
    return dataclasses.replace(costs, param_bytes=(grad, 0.0, 0.0), grad_bytes=(grad, 0.0, 0.0))


@pytest.mark.parametrize("grad", [1e3, 1e5])
def test_copies_of_a_pipeline_add_their_gradient_sum(grad: float) -> None:
    """6 devices, 8 rows of one row a micro-batch. One pipeline on all 6 is best uniform (tp=2 for
    each of the 3 layers): none of mixed widths. Two copies on 3 devices each, 4 rows apiece:
    layer 0 at tp=2 and the rest at 1, 6 + 6 + 3 x 6 = 30 s, then layer 0's gradient (half of
    `grad` bytes a tp rank, one bucket) summed over the copies at 1 kB/s after its last backward:
    0.5 s or 50 s, in full (one bucket: nothing of it runs before the last backward ends)."""
    link = Link(0.0, 1e3)
    cluster = Cluster(Network(link, link, 8), math.inf)
    zeros = (0.0,) * 3
    shares = {2: TpShares(2, (grad, 0.0, 0.0), (1.0, 0.0, 0.0), zeros, zeros, zeros, zeros, zeros)}  # layer 0 splits
    found = search_widths(_with_grads(grad), shares, 6, 8, cluster, (1, 2), replicas=(1, 2, 3))
    assert found is not None and found.dp == 2
    assert (found.layers_per_stage, found.widths, found.num_microbatches) == ((1, 2), (2, 1), 4)
    assert found.pipeline_s == pytest.approx(30.0)
    assert found.allreduce_s == pytest.approx((all_reduce(grad / 2, 2, link), 0.0))
    assert found.step_time_s == pytest.approx(30.0 + grad / 2 / 1e3 + all_reduce(CLOSING_BYTES, 6, link))
    assert found.to_dict()["dp"] == 2 and found.to_dict()["allreduce_s"] == list(found.allreduce_s)
    assert search_widths(_with_grads(grad), shares, 6, 8, cluster, (1, 2)) is None  # one pipeline: uniform wins


# -- the one search `plait plan` and Config() run, and its limits -----------------------------------

def test_the_limits_bound_the_worlds_and_the_tables() -> None:
    from plait.search.width_search import WIDTH_LIMITS

    assert [w for w in (2, 3, 16, 17, 64, 65) if WIDTH_LIMITS.allow(w, 26)] == [3, 16, 17, 64]
    assert [w for w in (2, 3, 16, 17, 64, 65) if WIDTH_LIMITS.allow(w, 26, dp=True)] == [3, 16]
    assert WIDTH_LIMITS.allow(64, 50) and not WIDTH_LIMITS.allow(64, 51)  # Alpa's GPT-39B is the largest table
    assert WIDTH_LIMITS.allow(9, 128) and not WIDTH_LIMITS.allow(10, 128)  # 128 layers: 9 devices at most
    assert WIDTH_LIMITS.allow(16, 100, dp=True) and not WIDTH_LIMITS.allow(16, 101, dp=True)


def test_the_one_search_is_each_pass_within_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.search.dp_widths import search_dp_widths
    from plait.search.search import SearchSpace
    from plait.search.width_search import StageWidths, WidthChoices, pipeline_copies, search_stage_widths

    costs, cluster = _costs((4.0, 1.0, 1.0)), Cluster(FREE, math.inf)
    shares = {2: _shares(3, 2, (1.0, 0.0, 0.0))}
    choices = WidthChoices((1, 2), dp=True, space=SearchSpace(num_microbatches=(4,)))
    found = search_stage_widths(costs, shares, 3, 4, cluster, choices)
    assert found.tp == search_widths(costs, shares, 3, 4, cluster, (1, 2), (4,), replicas=pipeline_copies(3))
    assert found.tp is not None and found.dp == search_dp_widths(costs, 3, 4, cluster, SearchSpace(num_microbatches=(4,)))
    assert found.fastest() is min([f for f in (found.tp, found.dp) if f is not None], key=lambda f: f.step_time_s)
    # only the schedules stages of different widths run: none asked, nothing searched
    assert search_stage_widths(costs, shares, 3, 4, cluster, WidthChoices((1, 2), True, SearchSpace(
        schedules=("zbh1",)))) == StageWidths()
    # beyond the limits neither pass runs
    import plait.search.width_search as width_search

    ran: list[str] = []
    monkeypatch.setattr(width_search, "search_widths", lambda *args, **kwargs: ran.append("tp"))
    monkeypatch.setattr(width_search, "search_dp_widths", lambda *args, **kwargs: ran.append("dp"))
    for world in (2, 17, 65):
        search_stage_widths(costs, shares, world, 4, cluster, choices)
    assert ran == ["tp"]  # 17 ranks: the tp pass only
    search_stage_widths(_costs((1.0,) * 51), {}, 64, 4, cluster, choices)  # 51 layers on 64: over the table
    assert ran == ["tp"]


def test_a_step_to_beat_prunes_the_dp_pass_by_the_tp_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # Config() gives the best uniform step: the dp pass need only beat it and the tp pass's best
    import plait.search.width_search as width_search
    from plait.search.search import SearchSpace
    from plait.search.width_search import WidthChoices, search_stage_widths

    costs, cluster = _costs((4.0, 1.0, 1.0)), Cluster(FREE, math.inf)
    shares = {2: _shares(3, 2, (1.0, 0.0, 0.0))}
    beats: list[float] = []
    monkeypatch.setattr(width_search, "search_dp_widths", lambda *args: beats.append(args[-1]))
    choices = WidthChoices((1, 2), dp=True, space=SearchSpace(num_microbatches=(4,)))
    tp = search_stage_widths(costs, shares, 3, 4, cluster, choices, beat=1e9).tp
    search_stage_widths(costs, shares, 3, 4, cluster, choices)  # `plait plan`: each pass's best
    assert tp is not None and beats == [tp.step_time_s, math.inf]
