"""Tests for plait.search.dp_widths: one pipeline whose stages take different data-parallel widths,
against every cut and width assignment on random instances, and by hand."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from plait.cost.network import Link, Network, all_reduce
from plait.cost.prediction import CLOSING_BYTES, Cluster
from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import Setting
from plait.search.dp_widths import dp_width_costs, dp_widths, price_dp_layout, row_cut_times, search_dp_widths
from plait.search.search import SearchSpace
from plait.search.submesh import WidthLayout, width_partition
from plait.search.tp_degree import search_tp

NET = Network(Link(0.0, 1e9), Link(0.0, 1e9), 8)
ONE_CASE = SearchSpace(num_microbatches=(4,), schedules=("1f1b",), recompute=(False,))


def _costs(forward: tuple[float, ...], grads: tuple[float, ...] | None = None) -> LayerCosts:
    """Layers costing `forward` a row forward and twice that backward, with `grads` gradient bytes
    (as many parameter bytes) and nothing else."""
    n = len(forward)
    zeros = (0.0,) * n
    grads = grads or zeros
    return LayerCosts(tuple(f"l{i}" for i in range(n)), zeros, forward, zeros, tuple(2 * f for f in forward),
                      zeros, zeros, zeros, zeros, grads, grads, zeros)


def _uniform_best(costs: LayerCosts, world: int, batch: int, cluster: Cluster) -> float:
    return search_tp(costs, {}, world, batch, cluster, SearchSpace(), degrees=(1,))[0].step_time_s


def _brute_force(costs: LayerCosts, world: int, batch: int, cluster: Cluster) -> tuple[float, float]:
    """(best step of one width, best step of mixed widths) over every m (powers of two), schedule,
    recomputation, cut and width assignment whose micro-batch rows divide by each width and whose
    stages fit."""
    n = costs.num_layers
    uniform = mixed = math.inf
    for m in (2**k for k in range(batch.bit_length()) if 2**k <= batch):
        if batch % m:
            continue
        rows = batch // m
        for schedule, again in itertools.product(("1f1b", "gpipe"), (False, True)):
            setting = Setting(1, 1, m, schedule, recompute=again)
            for p in range(1, n + 1):
                for cuts in itertools.combinations(range(1, n), p - 1):
                    bounds = [0, *cuts, n]
                    for widths in itertools.product([w for w in range(1, world) if w & (w - 1) == 0], repeat=p):
                        if sum(widths) != world or any(rows % w for w in widths):
                            continue
                        fits = all(dp_width_costs(costs, w, setting, cluster, batch).memory(
                            bounds[s], bounds[s + 1], m if schedule == "gpipe" else min(p - s, m))
                            <= cluster.memory_bytes for s, w in enumerate(widths))
                        if not fits:
                            continue
                        layers = tuple(b - a for a, b in zip(bounds, bounds[1:]))
                        step = price_dp_layout(costs, WidthLayout(layers, widths, 0.0), setting, cluster,
                                               batch).step_time_s
                        if len(set(widths)) > 1:
                            mixed = min(mixed, step)
                        else:
                            uniform = min(uniform, step)
    return uniform, mixed


@pytest.mark.parametrize("seed", range(40))
def test_the_search_is_the_brute_force_where_mixed_widths_win(seed: int) -> None:
    # no gradients and no optimizer step: the step is the pipeline (+ the closing), which the
    # partition minimises exactly; where a mixed layout is the fastest of all, the search finds it
    rng = random.Random(seed)
    n, world, batch = rng.randint(1, 5), rng.randint(3, 5), rng.choice([2, 4, 6, 8, 12])
    forward = tuple(rng.uniform(0.1, 5.0) for _ in range(n))
    zeros = (0.0,) * n
    state = tuple(rng.uniform(0, 40) for _ in range(n))
    fixed = tuple(rng.uniform(0, 3) for _ in range(n))  # time a replica takes whatever its rows
    costs = LayerCosts(tuple(f"l{i}" for i in range(n)), fixed, forward, fixed,
                       tuple(f * rng.uniform(1, 3) for f in forward), zeros, zeros,
                       tuple(rng.uniform(0, 5) for _ in range(n)), tuple(rng.uniform(0, 1e9) for _ in range(n)),
                       state, zeros, zeros, input_row_bytes=rng.uniform(0, 5),
                       uncuttable=((0, 1),) if n > 2 and seed % 4 == 0 else ())
    network = Network(Link(rng.uniform(0, 0.1), 1e9), Link(0.5, 1e9), rng.choice([2, 8]),
                      handover_cpu_s=rng.choice([0.0, 0.3, 1.5]))
    cluster = Cluster(network, rng.choice([math.inf, 60.0, 100.0]), optimizer_state_factor=0.0)
    uniform, mixed = _brute_force(costs, world, batch, cluster)
    found = search_dp_widths(costs, world, batch, cluster)
    if mixed < uniform - 1e-9:
        assert found is not None and found.step_time_s == pytest.approx(mixed)
    # asked to beat the uniform layouts: the same answer where it does, else none (the floors prune)
    beaten = search_dp_widths(costs, world, batch, cluster, beat=uniform)
    if found is not None and found.step_time_s < uniform:
        assert beaten is not None and beaten.step_time_s == pytest.approx(found.step_time_s)
    else:
        assert beaten is None
    if found is None:
        return
    assert found.step_time_s >= mixed - 1e-9  # nothing beats every layout
    rows = batch // found.num_microbatches
    assert len(set(found.dp)) > 1 and sum(found.dp) == world and batch % found.num_microbatches == 0
    assert all(rows % w == 0 for w in found.dp) and sum(found.layers_per_stage) == n
    again = price_dp_layout(costs, WidthLayout(found.layers_per_stage, found.dp, 0.0),
                            Setting(1, 1, found.num_microbatches, found.schedule, recompute=found.recompute),
                            cluster, batch)
    assert again.step_time_s == pytest.approx(found.step_time_s)


def test_every_micro_batch_divides_by_every_width() -> None:
    # 6 rows: m = 1 (6 rows: widths 1 and 2) is the only count that splits; m = 2 gives 3-row micro-batches
    costs = _costs((4.0, 1.0, 1.0))
    found = search_dp_widths(costs, 3, 6, Cluster(NET, math.inf))
    assert found is not None and found.num_microbatches == 1 and found.dp == (2, 1)
    assert search_dp_widths(costs, 3, 6, Cluster(NET, math.inf), SearchSpace(num_microbatches=(2,))) is None
    four = SearchSpace(num_microbatches=(3,))  # micro-batches of 4 rows
    assert search_dp_widths(costs, 3, 12, Cluster(NET, math.inf), four) is not None
    assert search_dp_widths(costs, 2, 8, Cluster(NET, math.inf)) is None  # 2 ranks: one width each
    assert dp_widths(3) == (1, 2) and dp_widths(8) == (1, 2, 4) and dp_widths(9) == (1, 2, 4, 8)


def test_a_heavy_layer_without_gradients_gets_two_replicas_and_wins() -> None:
    # layer 0 takes 12 a row and has no parameters; layers 1 and 2 take 3 a row and hold 4 GB of
    # gradients each, which any replicated stage all-reduces (4 s at 1 GB/s over 2, 5.3 s over 3)
    costs = _costs((4.0, 1.0, 1.0), (0.0, 4e9, 4e9))
    cluster = Cluster(NET, math.inf, optimizer_state_factor=0.0)
    found = search_dp_widths(costs, 3, 4, cluster)
    assert found is not None
    assert (found.layers_per_stage, found.dp, found.num_microbatches) == ((1, 2), (2, 1), 2)
    # 2 micro-batches of 2 rows: stage 0 runs 1 row (12), stage 1 both (12): 12 + 12 + 1 x 12
    assert found.pipeline_s == pytest.approx(36.0) and found.allreduce_s == (0.0, 0.0)
    assert found.step_time_s == pytest.approx(36.0 + all_reduce(CLOSING_BYTES, 3, NET.intra))
    assert found.step_time_s < _uniform_best(costs, 3, 4, cluster)  # pp=3: 54; dp=3: 36 + 5.3 s
    assert found.to_dict()["dp"] == [2, 1] and found.to_dict()["predicted_step_time_s"] == found.step_time_s


def test_stages_alike_in_work_and_gradients_lose_to_one_rank_each() -> None:
    # three equal layers, each with gradients: a pipeline of one rank a stage all-reduces nothing
    costs = _costs((1.0, 1.0, 1.0), (4e9, 4e9, 4e9))
    cluster = Cluster(NET, math.inf, optimizer_state_factor=0.0)
    found = search_dp_widths(costs, 3, 4, cluster)
    assert found is not None and max(found.allreduce_s) > 0
    assert found.step_time_s > _uniform_best(costs, 3, 4, cluster)


def test_the_gradients_steer_the_cut_away_from_a_replicated_embedding() -> None:
    # layer 0 (an embedding: little work, 4 GB of gradients) beside a heavy layer 1: by the pipeline
    # alone layer 0 shares the replicated stage (136.8 against 137.4 at m = 4), but its all-reduce
    # there costs 4 s; priced with the gradients, it goes to the stage of one rank
    costs = _costs((0.9, 10.0, 1.0), (4e9, 0.0, 0.0))
    cluster = Cluster(NET, math.inf, optimizer_state_factor=0.0)
    setting = Setting(1, 1, 4, "1f1b")
    table = {w: dp_width_costs(costs, w, setting, cluster, 8) for w in (1, 2)}
    cuts = row_cut_times(costs, 2, cluster, 3, (1, 2))
    plain = width_partition(table, cuts[(1, 1)], 3, 4, cross=cuts)
    assert (plain.layers_per_stage, plain.widths) == ((2, 1), (2, 1))
    found = search_dp_widths(costs, 3, 8, cluster, ONE_CASE)
    assert found is not None and (found.layers_per_stage, found.dp) == ((1, 2), (1, 2))
    assert found.pipeline_s == pytest.approx(137.4) and found.allreduce_s == (0.0, 0.0)
    worse = price_dp_layout(costs, plain, setting, cluster, 8)
    assert worse.step_time_s == pytest.approx(found.step_time_s - 137.4 + 136.8 + 4.0)


def test_the_gradient_all_reduce_by_hand() -> None:
    # stage 0 (layer 0, 1 GB of gradients) on 2 replicas, stage 1 (layer 1) on one; links 1 GB/s, 1 ms
    net = Network(Link(1e-3, 1e9), Link(1e-3, 1e9), 8)
    costs = _costs((1.0, 1.0), (1e9, 0.0))
    layout = WidthLayout((1, 1), (2, 1), 0.0)
    setting = Setting(1, 1, 2, "1f1b")
    ring = 2 * 1e-3 + 1e9 / 1e9  # 2 (p - 1) alpha + 2 (p - 1) / p x bytes / bandwidth, p = 2
    closing = all_reduce(CLOSING_BYTES, 3, net.intra)
    late = price_dp_layout(costs, layout, setting, Cluster(net, math.inf, overlap_gradients=False), 4)
    # stage 0: 1 row (3), stage 1: 2 rows (6); fills 3 + 6, no hand-over bytes, + 1 x 6
    assert late.pipeline_s == pytest.approx(15.0) and late.allreduce_s == (pytest.approx(ring), 0.0)
    assert late.step_time_s == pytest.approx(15.0 + ring + closing)
    # overlapped: the one bucket (the layer) is the last, so all of it follows the pipeline too
    early = price_dp_layout(costs, layout, setting, Cluster(net, math.inf), 4)
    assert early.step_time_s == pytest.approx(15.0 + ring + closing)
    # two layers on stage 0: the first bucket (layer 1's 1 GB) all-reduces during the 4 s backward,
    # the last (layer 0's 0.1 GB) after it; two collectives, each paying the latency
    split = _costs((1.0, 1.0, 1.0), (1e8, 1e9, 0.0))
    hidden = price_dp_layout(split, WidthLayout((2, 1), (2, 1), 0.0), setting, Cluster(net, math.inf), 4)
    assert hidden.pipeline_s == pytest.approx(6.0 + 6.0 + 6.0)
    assert hidden.allreduce_s[0] == pytest.approx(2 * 2e-3 + 1.1)
    assert hidden.step_time_s == pytest.approx(18.0 + 2e-3 + 0.1 + closing)


def test_hand_overs_that_take_the_ranks_time_favour_fewer_stages() -> None:
    # three layers of fixed work (2 a micro-batch, F + B, whatever the rows): by the pipeline alone
    # three stages of one rank (6 + 3 x 2 = 12) beat any mix (two stages: 6 + 3 x 4 = 18); with 5 s
    # of each hand-over on each rank (handover_term: 4 h (p - 1) + (m - 1) 4 h for p > 2, 4 h +
    # (m - 1) 2 h for p = 2) two stages win, 18 + 50 against 12 + 100, and one of them is replicated
    n = 3
    ones, zeros = (1.0,) * n, (0.0,) * n
    costs = LayerCosts(tuple(f"l{i}" for i in range(n)), ones, zeros, ones, zeros, zeros, zeros, zeros, zeros,
                       zeros, zeros, zeros)
    for busy, want in ((0.0, None), (5.0, 68.0)):
        cluster = Cluster(Network(Link(0.0, 1e9), Link(0.0, 1e9), 8, handover_cpu_s=busy), math.inf)
        found = search_dp_widths(costs, 3, 8, cluster, ONE_CASE)
        if want is None:
            assert found is None  # the partition's best is three stages of one rank: the uniform layouts'
        else:
            assert found is not None and sorted(found.dp) == [1, 2] and found.pipeline_s == pytest.approx(want)


def test_a_cut_is_priced_by_the_widths_it_joins() -> None:
    costs = replace(_costs((1.0, 1.0, 1.0), (0.0, 0.0, 0.0)), output_row_bytes=(1e6, 1e6, 1e6))
    cluster = Cluster(Network(Link(0.0, 1e9), Link(0.0, 1e9), 8), math.inf)
    cuts = row_cut_times(replace(costs, uncuttable=((1, 2),)), 4, cluster, 4, (1, 2))
    # 4 rows of 1 MB, forward and back: 2 -> 2 each replica its 2 rows; 2 -> 1 and 1 -> 2 all 4 on one rank
    assert cuts[(2, 2)][0] == pytest.approx(2 * 2e6 / 1e9) and cuts[(1, 1)][0] == pytest.approx(2 * 4e6 / 1e9)
    assert cuts[(2, 1)][0] == cuts[(1, 2)][0] == pytest.approx(2 * 4e6 / 1e9)
    assert cuts[(2, 2)][1] == math.inf  # inside the uncuttable region
