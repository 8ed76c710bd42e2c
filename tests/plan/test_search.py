"""The search: exact on small random cost arrays, the right splits, infeasible reasons, tables,
JSON, and the Alpa GPT suite's plans (their search time is `benchmarks/overheads.py`'s)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from plait.plan.analytic import ALPA_GPT_SUITE, gpt_costs, optimizer_state_factor
from plait.plan.cost import Cluster, Setting, partition_problem
from plait.plan.devices import device
from plait.plan.network import Link, Network
from plait.plan.partition import brute_force_partition
from plait.plan.search import SearchSpace, format_table, search
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
