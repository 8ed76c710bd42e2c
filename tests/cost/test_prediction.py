"""The cost model: schedule memory, closed forms against `simulate`, and a layout's step and memory
worked out by hand (the collective formulas: tests/cost/test_network.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from plait.cost.handovers import handover_busy, handover_term
from plait.cost.network import Link, Network
from plait.cost.prediction import (
    Cluster,
    Setting,
    microbatch_rows,
    partition_problem,
    peak_activations,
    pipeline_lower_bound,
    predict,
    step_lower_bound,
)
from plait.errors import ConfigError, PartitionError
from plait.schedule import simulate
from plait.search.partition import optimal_partition
from tests.plan.factory import layer_costs, random_costs

FREE = Network(Link(0.0, 1e30), Link(0.0, 1e30), 1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "interleaved"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9])
def test_peak_activations_are_the_programs(schedule: str, p: int, m: int) -> None:
    v = 2 if schedule == "interleaved" else 1
    for recompute in (False, True):
        setting = Setting(p, 1, m, schedule, v, recompute)
        release_on_w = schedule == "zbh1" and not recompute
        sim = simulate(schedule, p, m, 1, 1, t_w=1 if release_on_w else 0, num_virtual_stages=v)
        want = sim.peak_activations
        if schedule == "zbh1" and recompute:  # W runs inside B: released with B, as 1F1B
            want = simulate("1f1b", p, m, 1, 1).peak_activations
        assert list(peak_activations(setting)) == pytest.approx(want)


@pytest.mark.parametrize("schedule, p, m", [
    ("gpipe", 3, 1), ("gpipe", 4, 6), ("1f1b", 2, 5), ("1f1b", 4, 4), ("1f1b", 3, 7),
    ("zbh1", 3, 3), ("zbh1", 4, 9), ("zbh1", 4, 2), ("zbh1", 6, 1), ("interleaved", 2, 4),
    ("interleaved", 3, 6), ("interleaved", 2, 3), ("interleaved", 4, 2), ("interleaved", 8, 1),
])
def test_closed_form_is_simulates_step_for_uniform_stages(schedule: str, p: int, m: int) -> None:
    # one layer per stage, every layer alike, free hand-overs: the closed form the partition
    # minimises is exactly the simulated step (interleaved with m < p: a plain pipeline of its
    # p v chunks, 2x Megatron's (m + (p-1)/v) t at p = 8, m = 1)
    v = 2 if schedule == "interleaved" else 1
    costs = layer_costs(p * v, forward=2.0, backward=3.0, weight=1.0)
    setting = Setting(p, 1, m, schedule, v)
    cluster = Cluster(FREE, math.inf)
    problem = partition_problem(costs, setting, cluster, global_batch=m)  # one row each
    best = optimal_partition(problem)
    assert best.layers_per_stage == (1,) * (p * v)
    split = schedule == "zbh1"
    sim = simulate(schedule, p, m, 2 * v, 3 * v + (0 if split else v), t_w=v if split else 0,
                   num_virtual_stages=v)
    assert best.objective == pytest.approx(sim.step_time)
    assert predict(costs, setting, cluster, m, best.layers_per_stage).pipeline_s == pytest.approx(sim.step_time)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_interleaved_pays_every_hand_over_whole(m: int) -> None:
    # p = 4 ranks, v = 2 chunks each, hand-overs of 0.5 s each way beside chunks of 3 s: a
    # micro-batch crosses all 7 cuts in turn, in the fill and in the steady state alike, so
    # the closed form counts 2 x 0.5 per cut, not 1/v of it (34.0, 40.0, 64.0 simulated;
    # Megatron's 1/v gives 3.5 s less)
    costs = layer_costs(8, forward=1.0, backward=2.0, output=5e5)
    net = Network(Link(0.0, 1e6), Link(0.0, 1e6), 1)  # 0.5 MB per row -> 0.5 s per hand-over
    setting = Setting(4, 1, m, "interleaved", 2)
    cluster = Cluster(net, math.inf)
    sim = simulate("interleaved", 4, m, 2.0, 4.0, t_comm=0.5, num_virtual_stages=2)  # a rank's F, B
    assert predict(costs, setting, cluster, m, (1,) * 8).pipeline_s == pytest.approx(sim.step_time)
    closed = predict(costs, setting, cluster, m, (1,) * 8, simulate=False)
    assert closed.pipeline_s == pytest.approx(sim.step_time)


def test_gpipe_closed_form_counts_hand_overs_both_ways() -> None:
    costs = layer_costs(3, forward=1.0, backward=2.0, output=1e6)
    net = Network(Link(0.0, 1e6), Link(0.0, 1e6), 1)  # 1 MB per row -> 1 s per hand-over
    setting = Setting(3, 1, 4, "gpipe")
    pred = predict(costs, setting, Cluster(net, math.inf), 4, (1, 1, 1))
    assert pred.pipeline_s == pytest.approx((4 + 3 - 1) * 3 + 2 * 2 * 1.0)
    assert pred.method == "simulated"
    closed = predict(costs, setting, Cluster(net, math.inf), 4, (1, 1, 1), simulate=False)
    assert closed.pipeline_s == pytest.approx(pred.pipeline_s) and closed.method == "closed form"


@pytest.mark.parametrize("schedule, m", [("1f1b", 4), ("gpipe", 3), ("zbh1", 5), ("interleaved", 4)])
def test_a_hand_over_busy_on_its_ranks_lengthens_both_passes(schedule: str, m: int) -> None:
    # CPU ranks: each hand-over takes h from the sending and the receiving rank; with two
    # ranks every chunk but the ends sends and receives across two boundaries
    h = 0.25
    assert handover_busy(3, h) == [h, 2 * h, h] and handover_busy(1, h) == [0.0]
    v = 2 if schedule == "interleaved" else 1
    costs = layer_costs(2 * v, forward=2.0, backward=3.0, weight=1.0)
    setting = Setting(2, 1, m, schedule, v)
    busy = Cluster(Network(Link(0.0, 1e30), Link(0.0, 1e30), 1, handover_cpu_s=h), math.inf)
    layers = (1,) * (2 * v)
    pred = predict(costs, setting, busy, m, layers)
    free = predict(costs, setting, Cluster(FREE, math.inf), m, layers)
    assert [st.forward_s - f.forward_s for st, f in zip(pred.stages, free.stages)] == handover_busy(2 * v, h)
    assert [st.backward_s - f.backward_s for st, f in zip(pred.stages, free.stages)] == handover_busy(2 * v, h)
    assert pred.pipeline_s > free.pipeline_s
    if v == 1:  # two chunks, both ends: uniform stages, where the closed form is the simulated step
        split = schedule == "zbh1"
        sim = simulate(schedule, 2, m, 2 + h, 3 + h + (0 if split else 1), t_w=1 if split else 0)
        assert pred.pipeline_s == pytest.approx(sim.step_time)
        closed = predict(costs, setting, busy, m, layers, simulate=False)
        assert closed.pipeline_s == pytest.approx(sim.step_time)
        assert closed.pipeline_s - free.pipeline_s == pytest.approx(handover_term(setting, h))
    assert handover_term(Setting(1, 2, m, "1f1b"), h) == 0.0  # one stage: nothing handed over


def test_memory_of_a_layout_by_hand() -> None:
    # 4 layers, 2 stages, 1F1B with 4 micro-batches of 2 rows: stage 0 holds 2, stage 1 one
    costs = layer_costs(4, activation=10.0, params=100.0, output=3.0)
    cluster = Cluster(FREE, math.inf, optimizer_state_factor=2.0)
    pred = predict(costs, Setting(2, 1, 4, "1f1b"), cluster, 8, (1, 3))
    # state: params 100 + grads 100 + Adam 200 per layer
    assert pred.memory_bytes == (400 + 2 * 10 * 2, 3 * 400 + 1 * 3 * 10 * 2)
    whole = predict(costs, Setting(2, 1, 4, "1f1b", recompute=True), replace(cluster, recompute_by_layer=False), 8, (1, 3))
    # recomputation keeps each held micro-batch's input (model input 0 bytes, then 3 per row)
    # and one micro-batch's activations
    assert whole.memory_bytes == (400 + 0 + 1 * 10 * 2, 3 * 400 + 1 * 3 * 2 + 3 * 10 * 2)
    assert whole.recompute_by_layer == ()
    # layer by layer (each layer its own piece here): each layer's input kept, one layer's
    # activations while it is recomputed -- less on stage 1 (3 layers), the same on stage 0
    recomputed = predict(costs, Setting(2, 1, 4, "1f1b", recompute=True), cluster, 8, (1, 3))
    assert recomputed.memory_bytes == (400 + 0 + 1 * 10 * 2, 3 * 400 + 1 * 3 * (3 * 2) + 1 * 10 * 2)
    assert recomputed.recompute_by_layer == (1,)
    # with many micro-batches held, keeping every layer's input costs more: whole again
    gpipe = predict(costs, Setting(2, 1, 4, "gpipe", recompute=True), cluster, 8, (1, 3))
    assert gpipe.memory_bytes[1] == 3 * 400 + 4 * 3 * 2 + 3 * 10 * 2 and gpipe.recompute_by_layer == ()
    assert pred.peak_memory_bytes == max(pred.memory_bytes)


def test_all_reduce_overlaps_only_the_last_gradient_pass() -> None:
    # one stage, 2 replicas, 1 micro-batch of 1 row: F 1 s, B 2 s; gradients 4e9 bytes over
    # 1 GB/s: ring all-reduce 2 (2-1)/2 x 4 s = 4 s. One layer is one bucket, and the last
    # bucket starts when the backward ends (at 3 s): 3 + 4 + optimizer
    costs = layer_costs(1, params=4e9, optimizer=0.5)
    net = Network(Link(0.0, 1e9), Link(0.0, 1e9), 1)
    pred = predict(costs, Setting(1, 2, 1), Cluster(net, math.inf), 2, (1,))
    assert pred.allreduce_s == (pytest.approx(4.0),)
    assert pred.step_time_s == pytest.approx(3 + 4 + 64 / 1e9 + 0.5)  # + the loss sums' all-reduce


@pytest.mark.parametrize("first_layer, last_layer, step", [
    (2e6, 2e6, 6 + 2),  # buckets [layer 1] [layer 0]: the last (2 s) after the backward's end
    (2e6, 10e6, 2 + 12),  # 12 s of all-reduce from the last B's start (2 s) outlasts both
])
def test_the_last_bucket_starts_when_the_backward_ends(first_layer, last_layer, step) -> None:
    # two layers, one stage, 2 replicas, 1 row: F 1 + 1, B 2 + 2 (the last B starts at 2 s,
    # ends at 6 s); 1 MB/s, so an all-reduce of n bytes between 2 replicas takes n / 1e6 s
    import dataclasses

    costs = dataclasses.replace(layer_costs(2), grad_bytes=(first_layer, last_layer))
    net = Network(Link(0.0, 1e6), Link(0.0, 1e6), 1)
    pred = predict(costs, Setting(1, 2, 1), Cluster(net, math.inf), 2, (2,))
    assert pred.allreduce_s == (pytest.approx((first_layer + last_layer) / 1e6),)
    assert pred.closing_s == pytest.approx(64 / 1e6)  # the loss sums' all-reduce, then the step ends
    assert pred.step_time_s == pytest.approx(step + pred.closing_s)


def test_the_gradient_sum_pays_a_latency_for_each_collective_the_runtime_issues() -> None:
    # layers of 8 MiB, 8 MiB and 1 KiB of gradients: buckets [1 KiB, 8 MiB] and [8 MiB] in backward
    # order, the large ones reduced alone and the small one in its bucket's buffer: 3 collectives.
    # 2 replicas, a link of 1 s latency and no cost per byte: each all-reduce 2 (p - 1) alpha = 2 s,
    # three of them 6 s (one all-reduce of the sum: 2 s)
    import dataclasses

    costs = dataclasses.replace(layer_costs(3), grad_bytes=(8.0 * 2**20, 8.0 * 2**20, 1024.0))
    slow = Network(Link(1.0, 1e30), Link(1.0, 1e30), 1)
    pred = predict(costs, Setting(1, 2, 1), Cluster(slow, math.inf, overlap_gradients=False), 2, (3,))
    assert pred.allreduce_s == (pytest.approx(6.0),)


def test_every_rank_meets_at_the_loss_all_reduce_before_its_optimizer_step() -> None:
    # 2 stages, 1 micro-batch of 1 row, F 1 and B 2 per layer, hand-overs 0.5 s of latency:
    # F0 0-1, F1 1.5-2.5, B1 2.5-4.5, B0 5-7. Rank 1 steps its optimizer in 3 s, rank 0 in none.
    # Where the sums take an all-reduce (tp lanes), the ranks meet in it (2 (p-1) alpha = 1 s)
    # when rank 0 ends at 7, so the step is 7 + 1 + 3, not max(7 + 0, 4.5 + 3) as if each rank
    # went on alone. One rank per stage, the sums ride on the gradients: each rank does go on
    # alone, and the step is rank 1's 4.5 + 3.
    import dataclasses

    costs = dataclasses.replace(layer_costs(2, output=1.0), optimizer_s=(0.0, 3.0))
    slow = Network(Link(0.5, 1e30), Link(0.5, 1e30), 1)
    pred = predict(costs, Setting(2, 1, 1, "gpipe"), Cluster(slow, math.inf, ride_sums=False), 1, (1, 1))
    assert pred.pipeline_s == pytest.approx(7.0) and pred.closing_s == pytest.approx(1.0)
    assert pred.step_time_s == pytest.approx(7 + 1 + 3)
    riding = predict(costs, Setting(2, 1, 1, "gpipe"), Cluster(slow, math.inf), 1, (1, 1))
    assert riding.closing_s == 0.0 and riding.step_time_s == pytest.approx(4.5 + 3)


def test_all_reduces_are_priced_on_the_link_measured_for_them() -> None:
    # the ping-pong link is fast; the all-reduce was measured 10 x slower: it prices the step
    costs = layer_costs(1, params=4e9)
    fast, slow = Link(0.0, 1e10), Link(0.0, 1e9)
    measured = Network(fast, fast, 2, reduce_intra=slow)  # ranks 0 and 1 share a node
    assert predict(costs, Setting(1, 2, 1), Cluster(measured, math.inf), 2, (1,)).allreduce_s == (pytest.approx(4.0),)
    assert predict(costs, Setting(1, 2, 1), Cluster(Network(fast, fast, 2), math.inf), 2, (1,)).allreduce_s == (
        pytest.approx(0.4),)
    assert Network.from_dict(measured.to_dict()) == measured
    assert Network.from_dict(Network(fast, slow, 2).to_dict()).reduce_link([0, 2]) == slow  # none measured


def test_lower_bound_never_exceeds_a_layout() -> None:
    import random

    rng = random.Random(0)
    for _ in range(200):
        costs = random_costs(rng, rng.randint(2, 7))
        p = rng.randint(1, costs.num_layers // 2 if costs.num_layers >= 4 else 1)
        name = rng.choice(["gpipe", "1f1b", "zbh1", "interleaved"] if p > 1 else ["1f1b"])
        v = 2 if name == "interleaved" else 1
        if rng.random() < 0.3:  # batched weight gradients: W's fixed part paid once a step
            costs = replace(costs, weight_fixed_s=tuple(float(rng.randint(0, 3)) for _ in costs.names))
        setting = Setting(p, 1, rng.randint(1, 6), name, v, rng.random() < 0.3,
                          batch_weight_grads=rng.random() < 0.4)
        best = optimal_partition(partition_problem(costs, setting, Cluster(FREE, math.inf), 12))
        assert pipeline_lower_bound(costs, setting, 12) <= best.objective + 1e-9


def test_the_search_bound_never_exceeds_a_layouts_closed_form() -> None:
    # hand-overs, a busy CPU, replicas, ZeRO and uncuttable regions: the bound the search
    # prunes with stays below the closed form of the best layout and of any other one
    import random

    rng = random.Random(1)
    net = Network(Link(0.5, 20.0), Link(2.0, 5.0), 2, handover_cpu_s=0.25)
    for _ in range(200):
        costs = random_costs(rng, rng.randint(3, 8))
        if rng.random() < 0.3:
            costs = replace(costs, uncuttable=((0, 1),))
        p = rng.randint(1, (costs.num_layers - 1) // 2 if costs.num_layers >= 5 else 1)
        name = rng.choice(["gpipe", "1f1b", "zbh1", "interleaved"] if p > 1 else ["1f1b"])
        v = 2 if name == "interleaved" else 1
        dp = rng.choice([1, 2, 3])
        setting = Setting(p, dp, rng.randint(1, 6), name, v, rng.random() < 0.3,
                          zero=rng.choice([0, 1, 2]) if dp > 1 else 0,
                          batch_weight_grads=rng.random() < 0.3)
        cluster = Cluster(net, math.inf)
        bound = step_lower_bound(costs, setting, cluster, 12)
        best = optimal_partition(partition_problem(costs, setting, cluster, 12))
        closed = predict(costs, setting, cluster, 12, best.layers_per_stage, simulate=False)
        assert bound <= closed.step_time_s
        if dp > 1:  # the closing all-reduce at least (one rank per stage: the sums ride, none)
            assert bound > pipeline_lower_bound(costs, setting, 12)


def test_rows_and_settings() -> None:
    assert microbatch_rows(1024, 2, 8) == 64
    assert microbatch_rows(10, 3, 2) == 2  # ceil(ceil(10 / 3) / 2)
    with pytest.raises(ConfigError, match="needs schedule='interleaved'"):
        Setting(2, 1, 4, "1f1b", num_virtual_stages=2)
    with pytest.raises(ConfigError, match="not known"):
        Setting(2, 1, 4, "pipedream")
    with pytest.raises(ConfigError, match="does not cut 4 layers into 2 stages"):
        predict(layer_costs(4), Setting(2, 1, 1), Cluster(FREE, 1.0), 1, (1, 1, 2))


def test_zero_memory_of_a_layout_by_hand() -> None:
    # the layout of test_memory_of_a_layout_by_hand on 2 replicas: 4 micro-batches of 2 rows
    # (16 rows over dp=2); stage 0 holds 2 of them, stage 1 one. Per layer: parameters 100,
    # gradients 100, Adam 200 -- sharded over the 2 replicas with ZeRO: 100
    costs = layer_costs(4, activation=10.0, params=100.0, output=3.0)
    cluster = Cluster(FREE, math.inf, optimizer_state_factor=2.0)
    plain = predict(costs, Setting(2, 2, 4, "1f1b"), cluster, 16, (1, 3))
    assert plain.parameter_bytes == (100, 300) and plain.gradient_bytes == (100, 300)
    assert plain.optimizer_bytes == (200, 600) and plain.activation_bytes == (2 * 10 * 2, 1 * 3 * 10 * 2)
    assert plain.memory_bytes == (440, 1260)
    for zero in (1, 2):  # ZeRO-2's gradients all exist during the backward: its peak is ZeRO-1's
        sharded = predict(costs, Setting(2, 2, 4, "1f1b", zero=zero), cluster, 16, (1, 3))
        assert sharded.parameter_bytes == plain.parameter_bytes
        assert sharded.gradient_bytes == plain.gradient_bytes
        assert sharded.optimizer_bytes == (100, 300)
        assert sharded.activation_bytes == plain.activation_bytes
        assert sharded.memory_bytes == (340, 960) == tuple(
            map(sum, zip(sharded.parameter_bytes, sharded.gradient_bytes, sharded.optimizer_bytes,
                         sharded.activation_bytes)))
        assert [st.state_bytes for st in sharded.stages] == [300, 900]
        # the partition's memory is the same: each layer's 300 bytes of state
        problem = partition_problem(costs, Setting(2, 2, 4, "1f1b", zero=zero), cluster, 16)
        assert list(problem.fixed) == [300.0] * 4


def test_a_layout_that_fits_only_with_zero_is_feasible_with_it() -> None:
    costs = layer_costs(4, params=100.0)  # 400 bytes of state per layer, 300 with ZeRO on 2 replicas
    limit = Cluster(FREE, 2 * 350.0)
    assert optimal_partition(partition_problem(costs, Setting(2, 2, 1, zero=1), limit, 2)).layers_per_stage == (2, 2)
    with pytest.raises(PartitionError, match="needs at least"):
        optimal_partition(partition_problem(costs, Setting(2, 2, 1), limit, 2))


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_communication_by_hand(dp: int) -> None:
    # one stage of one layer, dp replicas, 1 micro-batch of 1 row: F 0-1 s, B 1-3 s; 4e9 bytes
    # of gradients; sums over the all-reduce's measured 0.5 GB/s, copies over the 1 GB/s link;
    # the optimizer steps every parameter in 0.5 s. One layer is one bucket: it starts when the
    # backward ends (3 s).
    costs = layer_costs(1, params=4e9, optimizer=0.5)
    net = Network(Link(0.0, 1e9), Link(0.0, 1e9), 1, reduce_intra=Link(0.0, 0.5e9), reduce_inter=Link(0.0, 0.5e9))
    cluster = Cluster(net, math.inf)
    p = dp
    ring_all_reduce = 2 * (p - 1) / p * 8.0  # 2(p-1)/p x V / B
    # as the runtime issues them: each owner's V/p reduced to it (gradients, at the all-reduce's
    # rate) or broadcast from it (parameters: copies, at the link's), one owner after another,
    # each over a binary tree of log2(p) hops
    reduce_scatter = p * math.ceil(math.log2(p)) * (8.0 / p)
    all_gather = p * math.ceil(math.log2(p)) * (4.0 / p)
    closing = 2 * (dp - 1) * 64 / (dp * 0.5e9)
    zero0, zero1, zero2 = (predict(costs, Setting(1, dp, 1, zero=z), cluster, dp, (1,)) for z in (0, 1, 2))
    assert zero0.allreduce_s == (pytest.approx(ring_all_reduce),) and zero0.gather_s == (0.0,)
    assert zero0.optimizer_s == (0.5,)
    assert zero0.step_time_s == pytest.approx(3 + ring_all_reduce + closing + 0.5)
    # ZeRO-1: the same all-reduce; a 1/dp share stepped, then broadcast to the others
    assert zero1.allreduce_s == zero0.allreduce_s and zero1.optimizer_s == (pytest.approx(0.5 / dp),)
    assert zero1.gather_s == (pytest.approx(all_gather),)
    assert zero1.step_time_s == pytest.approx(3 + ring_all_reduce + closing + 0.5 / dp + all_gather)
    # ZeRO-2: each bucket reduced to its owners instead (on 2 replicas: as long as the all-reduce)
    assert zero2.allreduce_s == (pytest.approx(reduce_scatter),) and zero2.gather_s == zero1.gather_s
    assert zero2.step_time_s == pytest.approx(3 + reduce_scatter + closing + 0.5 / dp + all_gather)
    # where the runtime all-reduces ZeRO-2's buckets (gloo), they are priced as all-reduces
    gloo = predict(costs, Setting(1, dp, 1, zero=2), Cluster(net, math.inf, owner_reduces=False), dp, (1,))
    assert gloo.allreduce_s == zero0.allreduce_s and gloo.gather_s == zero1.gather_s
    assert (gloo.allreduce_s[0] < zero2.allreduce_s[0]) == (dp > 2)


def test_zero_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="zero=1 shards over a stage's replicas, but dp=1 has one "
                                          "replica; set dp > 1 or zero=0"):
        Setting(2, 1, 4, zero=1)
    with pytest.raises(ConfigError, match="zero must be 0, 1, 2 or 3, got 4"):
        Setting(2, 2, 4, zero=4)
    assert Setting(2, 2, 4, zero=2).zero == 2 and Setting(2, 1, 4).zero == 0


def test_zero3_with_weight_gradients_late_sums_its_gradients_after_them() -> None:
    """ZB-H1 or batched weight gradients at zero=3 reduce-scatter every gradient after the rank's last
    weight gradients (the runtime's `ShardedParameters.after_backward`): no overlap with the backward,
    whatever the cluster allows; 1F1B at zero=3 overlaps its last gradient pass as before."""
    import dataclasses

    costs = dataclasses.replace(layer_costs(4, forward=1e-3, backward=2e-3, params=4e6))
    slow = Network(Link(1e-4, 1e7), Link(1e-4, 1e7), 1)
    steps = {}
    for schedule, batched in (("zbh1", False), ("1f1b", True), ("1f1b", False)):
        for overlap in (True, False):
            setting = Setting(2, 2, 4, schedule, zero=3, batch_weight_grads=batched)
            pred = predict(costs, setting, Cluster(slow, math.inf, overlap_gradients=overlap), 16, (2, 2))
            steps[schedule, batched, overlap] = pred.step_time_s
    assert steps["zbh1", False, True] == steps["zbh1", False, False]
    assert steps["1f1b", True, True] == steps["1f1b", True, False]
    assert steps["1f1b", False, True] < steps["1f1b", False, False]
