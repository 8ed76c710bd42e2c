"""The search: exact on small random cost arrays, the right splits, infeasible reasons, tables,
JSON, and the Alpa GPT suite's plans (their search time is `benchmarks/overheads.py`'s)."""

from __future__ import annotations

import dataclasses

import itertools
import json
import math
import random
from dataclasses import replace

import pytest

from plait.cost.analytic import ALPA_GPT_SUITE, gpt_costs
from plait.cost.memory import optimizer_state_factor
from plait.cost.devices import device
from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster, Setting, partition_problem, predict
from plait.errors import ConfigError
from plait.search.partition import brute_force_partition
from plait.search.search import SearchSpace, format_table, search
from tests.plan.factory import layer_costs, random_costs

FREE = Network(Link(0.0, 1e30), Link(0.0, 1e30), 1)
REQUIRED = {"pp", "dp", "tp", "num_microbatches", "schedule", "stages", "predicted_step_time_s",
            "peak_memory_bytes", "feasible"}


@pytest.mark.parametrize("seed", range(25))
def test_best_closed_form_equals_exhaustive_search(seed: int) -> None:
    # dp = 1 and no optimizer: the step is the pipeline's closed form; branch and bound and the
    # partition must find the minimum over every setting and every composition
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(2, 6))
    costs = type(costs).from_dict({**costs.to_dict(), "optimizer_s": [0.0] * costs.num_layers})
    world = rng.randint(1, min(4, costs.num_layers))
    limit = rng.choice([math.inf, 600.0, 900.0])
    cluster = Cluster(FREE, limit)
    space = SearchSpace(pp=(world,), keep=1, simulate_top=0, num_microbatches=(1, 2, 3, 4))
    got = search(costs, world, 8, cluster, space)
    best = math.inf
    for m, name, recompute in itertools.product((1, 2, 3, 4), space.schedules, (False, True)):
        v = 2 if name == "interleaved" else 1
        if world * v > costs.num_layers or (world == 1 and name != "1f1b") or (name == "interleaved" and world < 2):
            continue
        found = brute_force_partition(partition_problem(costs, Setting(world, 1, m, name, v, recompute), cluster, 8))
        if found is not None:
            best = min(best, found.objective)
    if math.isinf(best):
        assert not got[0].feasible and got[0].reason
    else:
        assert got[0].feasible and got[0].closed_form_s == pytest.approx(best)


def test_heavy_early_layers_get_fewer_layers_and_uniform_ones_split_evenly() -> None:
    cluster = Cluster(FREE, math.inf)
    space = SearchSpace(pp=(2,), schedules=("1f1b",), recompute=(False,), num_microbatches=(8,))
    uniform = search(layer_costs(8), 2, 64, cluster, space)[0]
    assert uniform.layers_per_stage == (4, 4)
    heavy = layer_costs(8)
    heavy = type(heavy).from_dict({**heavy.to_dict(), "forward_row_s": [20, 1, 1, 1, 1, 1, 1, 1]})
    # layer times F + B: 22, then 3 each: (1, 7) has stages of 22 and 21
    assert search(heavy, 2, 64, cluster, space)[0].layers_per_stage == (1, 7)


def test_refined_candidates_are_simulated_and_sorted() -> None:
    costs = layer_costs(6, forward=1e-3, backward=2e-3, activation=1e3, params=1e6, output=1e3)
    cluster = Cluster(Network(Link(1e-5, 1e9), Link(1e-4, 1e8), 2), 1e9)
    found = search(costs, 4, 64, cluster)
    assert len(found) == 5 and all(c.feasible for c in found)
    assert found[0].prediction is not None and found[0].prediction.method == "simulated"
    times = [c.step_time_s for c in found]
    assert times == sorted(times)
    table = format_table(found)
    assert "stage  0 (rank 0)" in table and "F+B+W" in table and "GiB" in table
    data = found[0].to_dict()
    assert REQUIRED <= set(data) and data["feasible"] is True and "reason" not in data
    assert len(data["stages"]) == found[0].setting.num_chunks
    json.dumps(data)


def test_a_layer_larger_than_the_device_needs_tensor_parallelism() -> None:
    costs = layer_costs(4, params=2**30)  # 4 GiB of state per layer with Adam
    found = search(costs, 4, 16, Cluster(FREE, 3 * 2**30))
    assert not any(c.feasible for c in found)
    data = found[0].to_dict()
    assert REQUIRED | {"reason"} <= set(data)
    assert data["feasible"] is False and "needs tensor parallelism" in data["reason"]
    assert "layer" in data["reason"] and "alone needs 4.00 GiB" in data["reason"]


@pytest.mark.parametrize("gpus", sorted(ALPA_GPT_SUITE))
def test_alpa_gpt_suite_plans(gpus: int) -> None:
    label, spec = ALPA_GPT_SUITE[gpus]
    dev = device("v100-16gb")
    cluster = Cluster(dev.network, dev.usable_memory(), optimizer_state_factor("adam", dev.dtype_bytes))
    found = search(gpt_costs(spec, dev), gpus, 1024, cluster)
    best = found[0]
    if gpus <= 32:
        assert best.feasible, best.reason
        assert best.setting.pp * best.setting.dp == gpus
        assert best.prediction is not None and best.prediction.peak_memory_bytes <= cluster.memory_bytes
    else:  # 39B: 12.9 GB of state per block on 16 GB devices, at most 32 stages of 50 layers
        assert not best.feasible and "needs tensor parallelism" in best.reason
        # ZeRO-3 on dp=2 brings a block to 0.75 + 1.5 + 4.5 GiB, but 48 blocks on 32 stages put two
        # on 16 of them: 13.5 GiB of state before activations, and the held micro-batches' inputs
        # and one block's recomputation take it over the 14.4 GiB a V100 offers (ZeRO-1/2: 16.11)
        assert best.setting.zero == 3 and (best.setting.pp, best.setting.dp) == (32, 2)
        # (recomputed layer by layer: each of the two blocks' inputs kept, one block recomputed)
        assert best.needed_memory_bytes / 2**30 == pytest.approx(14.61, abs=0.01)
        assert "with ZeRO, recomputation and one-row micro-batches" in best.reason


def test_zero_makes_the_15b_gpt_on_32_v100_no_slower() -> None:
    label, spec = ALPA_GPT_SUITE[32]
    dev = device("v100-16gb")
    cluster = Cluster(dev.network, dev.usable_memory(), optimizer_state_factor("adam", dev.dtype_bytes))
    costs = gpt_costs(spec, dev)
    with_zero = search(costs, 32, 1024, cluster)[0]
    without = search(costs, 32, 1024, cluster, SearchSpace(zero=(0,)))[0]
    assert with_zero.feasible and without.feasible and without.setting.zero == 0
    assert with_zero.step_time_s <= without.step_time_s
    pred = with_zero.prediction
    assert pred is not None and pred.peak_memory_bytes <= cluster.memory_bytes


def levels_by_predict(costs, candidate, cluster, global_batch):
    """The step of the candidate's layout at each ZeRO level, priced by the cost model."""
    return {z: predict(costs, replace(candidate.setting, zero=z), cluster, global_batch,
                       candidate.layers_per_stage).step_time_s for z in (0, 1, 2)}


ONE_LAYOUT = SearchSpace(pp=(2,), num_microbatches=(8,), schedules=("1f1b",), recompute=(False,), zero=(0, 1, 2),
                         batch_weight_grads=(False,))


@pytest.mark.parametrize("optimizer", [0.0, 0.5])
def test_the_fastest_zero_level_by_the_model_wins(optimizer: float) -> None:
    # 2 stages x 2 replicas, memory ample: 2 MB of gradients per stage over 1 GB/s, mostly hidden
    # behind the backward for ZeRO 0, against a share of the optimizer step saved by ZeRO 1 and 2
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=1e6, optimizer=optimizer)
    cluster = Cluster(Network(Link(1e-5, 1e9), Link(1e-5, 1e9), 1), math.inf)
    found = search(costs, 4, 64, cluster, ONE_LAYOUT)
    assert sorted(c.setting.zero for c in found) == [0, 1, 2]
    best = found[0]
    steps = levels_by_predict(costs, best, cluster, 64)
    fastest = min(steps.values())
    assert best.step_time_s == pytest.approx(fastest, rel=1e-12)
    # the lowest level among the fastest: with no optimizer step to share, ZeRO-2's reduce-scatter
    # + all-gather on 2 replicas equals ZeRO-0's all-reduce, a tie up to rounding
    assert best.setting.zero == min(z for z in steps if steps[z] == pytest.approx(fastest, rel=1e-12))
    assert [c.step_time_s for c in found] == pytest.approx(sorted(c.step_time_s for c in found), rel=1e-12)


def test_left_to_the_search_zero_is_used_only_where_memory_needs_it() -> None:
    # the case above where ZeRO is the faster by the model: memory ample, the search keeps ZeRO 0
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=1e6, optimizer=0.5)
    cluster = Cluster(Network(Link(1e-5, 1e9), Link(1e-5, 1e9), 1), math.inf)
    assert search(costs, 4, 64, cluster, ONE_LAYOUT)[0].setting.zero > 0
    assert {c.setting.zero for c in search(costs, 4, 64, cluster, replace(ONE_LAYOUT, zero=None))} == {0}


def test_equal_steps_go_to_the_lower_zero_level() -> None:
    # a free network and no optimizer time: every level predicts the same step
    costs = layer_costs(4, params=1e6)
    found = search(costs, 4, 64, Cluster(FREE, math.inf), ONE_LAYOUT)
    assert [c.setting.zero for c in found] == [0, 1, 2]
    assert len({c.step_time_s for c in found}) == 1


def test_a_memory_limit_only_zero_meets_chooses_zero() -> None:
    # one stage on 2 replicas: 4 layers of 400 bytes of state each (parameters 100, gradients
    # 100, Adam 200), 300 with the optimizer state halved by ZeRO: 1600 or 1200 bytes
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=100.0, optimizer=1e-3)
    cluster = Cluster(Network(Link(1e-5, 1e6), Link(1e-5, 1e6), 1), 1300.0)
    space = SearchSpace(pp=(1,))
    found = search(costs, 2, 8, cluster, space)
    best = found[0]
    assert best.feasible and best.setting.zero in (1, 2) and all(c.setting.zero for c in found)
    assert best.prediction is not None and best.prediction.peak_memory_bytes == 1200.0
    steps = levels_by_predict(costs, best, cluster, 8)
    assert best.setting.zero == min((1, 2), key=lambda z: (round(steps[z], 12), z))
    replicated = search(costs, 2, 8, cluster, replace(space, zero=(0,)))
    assert not replicated[0].feasible and replicated[0].needed_memory_bytes == 1600.0
    assert "sharded optimizer state (ZeRO)" in replicated[0].reason


def test_a_memory_limit_only_sharded_parameters_meet_chooses_zero3() -> None:
    # as above, 1200 bytes at ZeRO-1/2; ZeRO-3 halves the parameters too: 4 x (50 + 100 + 100) = 1000
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=100.0, optimizer=1e-3)
    cluster = Cluster(Network(Link(1e-5, 1e6), Link(1e-5, 1e6), 1), 1100.0)
    found = search(costs, 2, 8, cluster, SearchSpace(pp=(1,), keep=50))
    assert found[0].feasible and {c.setting.zero for c in found} == {3}, found[0].reason
    assert found[0].prediction is not None and found[0].prediction.peak_memory_bytes == 1000.0
    # every schedule and batched weight gradients run beside it
    assert any(c.setting.batch_weight_grads for c in found)
    roomy = dataclasses.replace(cluster, memory_bytes=1e9)
    split = search(costs, 4, 8, roomy, SearchSpace(pp=(2,), schedules=("zbh1",), zero=(3,), keep=50))
    assert split[0].feasible and {(c.setting.schedule, c.setting.zero) for c in split} == {("zbh1", 3)}
    # priced with its stage's parameters gathered beside the gradients (2 layers of 100 bytes), 1F1B not
    one = {name: search(costs, 4, 8, roomy, SearchSpace(pp=(2,), schedules=(name,), zero=(3,), num_microbatches=(4,),
                                                        recompute=(False,)))[0] for name in ("zbh1", "1f1b")}
    assert one["zbh1"].prediction.peak_memory_bytes - one["1f1b"].prediction.peak_memory_bytes == 200.0
    # not tried beside tp or where it is left out (a replanning run): nothing fits
    assert not search(costs, 2, 8, cluster, SearchSpace(pp=(1,), zero3=False))[0].feasible


def test_a_given_zero_level_is_the_only_one_searched() -> None:
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=1e6, optimizer=1e-3)
    cluster = Cluster(Network(Link(1e-5, 1e9), Link(1e-5, 1e9), 1), math.inf)
    found = search(costs, 4, 64, cluster, SearchSpace(zero=(1,), keep=50))
    assert found and {c.setting.zero for c in found} == {1} and all(c.setting.dp > 1 for c in found)
    assert {c.setting.zero for c in search(costs, 4, 64, cluster, SearchSpace(zero=(0,), keep=50))} == {0}
    with pytest.raises(ConfigError, match="zero 1 and 2 need dp > 1"):
        search(costs, 4, 64, cluster, SearchSpace(pp=(4,), zero=(2,)))
    assert {c.setting.zero for c in search(costs, 4, 64, cluster, SearchSpace(keep=50))} == {0}  # memory ample
    three = search(costs, 4, 64, cluster, SearchSpace(pp=(2,), zero=(3,), keep=50))
    one = search(costs, 4, 64, cluster, SearchSpace(pp=(2,), zero=(1,), keep=50))
    assert three and {c.setting.zero for c in three} == {3}
    assert three[0].prediction.parameter_bytes[0] == one[0].prediction.parameter_bytes[0] / 2  # 1/dp each
    with pytest.raises(ConfigError, match="zero must be 0, 1, 2 or 3, got 4"):
        SearchSpace(zero=(4,))


def test_the_table_and_json_show_zero_and_the_chosen_memory() -> None:
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=2**20, activation=2**10, optimizer=0.5)
    cluster = Cluster(Network(Link(1e-5, 1e9), Link(1e-5, 1e9), 1), math.inf)
    found = search(costs, 4, 64, cluster, ONE_LAYOUT)
    data = found[0].to_dict()
    pred = found[0].prediction
    assert pred is not None and data["zero"] == found[0].setting.zero
    assert data["optimizer_bytes"] == list(pred.optimizer_bytes) == [2 * 2 * 2**20 / 2] * 2  # Adam, halved
    assert data["parameter_bytes"] == data["gradient_bytes"] == [2 * 2**20] * 2
    assert [sum(parts) for parts in zip(data["parameter_bytes"], data["gradient_bytes"], data["optimizer_bytes"],
                                        data["activation_bytes"])] == [s["memory_bytes"] for s in data["stages"]]
    table = format_table(found)
    assert " zero " in table.splitlines()[0]
    assert f"zero={found[0].setting.zero}" in table
    assert "memory 0.01 GiB (0.00 + 0.00 + 0.00 + 0.00)" in table  # MiBs: shown as GiB


def test_offload_is_priced_and_taken_only_where_nothing_else_fits() -> None:
    """zero=3 with offload: the device keeps only the gradients (4 x 100 = 400 bytes a rank here,
    1000 with zero=3 alone); each gather copies a shard in over the host link and the host steps the
    shards at its memory's bandwidth, so a layout that fits without it is faster and is taken."""
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=100.0, optimizer=1e-3)
    net = Network(Link(1e-5, 1e6), Link(1e-5, 1e6), 1)
    host = Cluster(net, 600.0, host_link=1e4, host_bandwidth=1e5)
    space = SearchSpace(pp=(1,), keep=50, offload=(False, True))
    found = search(costs, 2, 8, host, space)
    assert found[0].feasible and all(c.setting.offload and c.setting.zero == 3 for c in found), found[0].reason
    pred = found[0].prediction
    assert pred is not None and pred.peak_memory_bytes == 400.0 and pred.parameter_bytes[0] == 0.0
    plain = predict(costs, replace(found[0].setting, offload=False), host, 8, found[0].layers_per_stage)
    # in over the host link: 2 gathers a micro-batch of the rank's 200-byte shard; out: its 200 gradient bytes
    moved = (2 * found[0].setting.num_microbatches * 200.0 + 200.0) / 1e4
    assert pred.gather_s[0] == pytest.approx(plain.gather_s[0] + moved)
    assert pred.optimizer_s[0] == pytest.approx((3 + 2 * 2.0) * 200.0 / 1e5)  # Adam on the host: 7 bytes a byte
    roomy = search(costs, 2, 8, replace(host, memory_bytes=1100.0), space)  # zero=3 alone fits: no offload
    assert roomy[0].feasible and not any(c.setting.offload for c in roomy)
    assert not search(costs, 2, 8, host, replace(space, offload=(False,)))[0].feasible  # without it: nothing
    # CPU ranks (no host link): offload moves nothing, its memory and time are zero=3's
    cpu = Cluster(net, 1100.0)
    setting = replace(found[0].setting, offload=True)
    on_cpu, three = (predict(costs, s, cpu, 8, found[0].layers_per_stage) for s in (setting, replace(setting, offload=False)))
    assert on_cpu.memory_bytes == three.memory_bytes and on_cpu.step_time_s == three.step_time_s
    with pytest.raises(ConfigError, match="True only with zero=3"):
        replace(setting, zero=2)
