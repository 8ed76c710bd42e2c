"""Tests for plait.cost.layer_times: a setting's per-layer times, batched weight gradients priced
by hand and against the schedule's own program, and the lower bound the search prunes with."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from plait.cost.layer_times import DEFERRED_HOLD, flush_times, layer_times, pipeline_lower_bound
from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster, Setting, partition_problem, predict
from plait.search.partition import optimal_partition
from plait.search.search import SearchSpace, search
from tests.plan.factory import layer_costs

FREE = Network(Link(0.0, 1e30), Link(0.0, 1e30), 1)
# 4 layers: F 1 and B 2 per row, W 0.5 per pass + 1 per row, 10 activation bytes per row
COSTS = layer_costs(4, forward=1.0, backward=2.0, weight=1.0, weight_fixed=0.5, activation=10.0)


def test_batched_weight_gradients_by_hand() -> None:
    # 2 stages of 2 layers, 4 micro-batches of 1 row: per micro-batch a stage runs F 2 and B 4,
    # no W; after its last action each rank runs W over the step's 4 rows once: 2 x (0.5 + 4) = 9
    batched = Setting(2, 1, 4, "1f1b", batch_weight_grads=True)
    f, b, w = layer_times(COSTS, batched, 1)
    assert (f, b, w) == ([1.0] * 4, [2.0] * 4, [0.0] * 4)
    assert flush_times(COSTS, batched, 1) == [4.5] * 4
    simulated = predict(COSTS, batched, Cluster(FREE, math.inf), 4, (2, 2), simulate=True)
    # 1F1B: (m + p - 1)(F + B) = 30 for stage 0, which ends last, then its 9
    assert simulated.step_time_s == pytest.approx(39.0)
    assert [s.flush_s for s in simulated.stages] == [9.0, 9.0]
    closed = predict(COSTS, batched, Cluster(FREE, math.inf), 4, (2, 2), simulate=False)
    assert closed.step_time_s == pytest.approx(39.0)  # uniform stages: the closed form is exact
    # per micro-batch W is 2 x 1.5 = 3: (m + p - 1)(F + B + W) = 45
    unbatched = predict(COSTS, replace(batched, batch_weight_grads=False), Cluster(FREE, math.inf), 4, (2, 2))
    assert unbatched.step_time_s == pytest.approx(45.0)
    # memory: every micro-batch's linear inputs and output gradients held to the step's end
    assert simulated.activation_bytes == (4 * DEFERRED_HOLD * 20.0,) * 2
    assert unbatched.activation_bytes == (2 * 20.0, 1 * 20.0)  # 1F1B holds p - s


@pytest.mark.parametrize("schedule, p, m", [("1f1b", 2, 4), ("1f1b", 4, 8), ("gpipe", 3, 5), ("1f1b", 4, 2)])
def test_the_closed_form_is_the_programs_step_for_uniform_stages(schedule: str, p: int, m: int) -> None:
    costs = layer_costs(2 * p, forward=1.0, backward=2.0, weight=1.5, weight_fixed=2.0)
    setting = Setting(p, 1, m, schedule, batch_weight_grads=True)
    layers = (2,) * p
    simulated = predict(costs, setting, Cluster(FREE, math.inf), m, layers, simulate=True)
    closed = predict(costs, setting, Cluster(FREE, math.inf), m, layers, simulate=False)
    assert closed.step_time_s == pytest.approx(simulated.step_time_s)
    assert optimal_partition(partition_problem(costs, setting, Cluster(FREE, math.inf), m)).objective \
        == pytest.approx(simulated.pipeline_s)
    assert pipeline_lower_bound(costs, setting, m) <= simulated.pipeline_s + 1e-9


SPACE = SearchSpace(pp=(2,), num_microbatches=(4,), schedules=("1f1b", "zbh1"), keep=20, simulate_top=20)


def test_the_search_batches_where_it_pays_and_fits() -> None:
    found = search(COSTS, 2, 4, Cluster(FREE, math.inf), SPACE)
    assert found[0].setting.batch_weight_grads and found[0].step_time_s == pytest.approx(39.0)
    assert found[0].to_dict()["batch_weight_grads"] is True
    offered = [c.setting for c in found if c.setting.batch_weight_grads]
    assert offered and all(not s.recompute and s.schedule != "zbh1" for s in offered)
    # W without a fixed part: batching saves nothing and cannot overlap the pipeline
    plain = search(replace(COSTS, weight_fixed_s=(0.0,) * 4), 2, 4, Cluster(FREE, math.inf), SPACE)
    assert not plain[0].setting.batch_weight_grads
    # memory for 1F1B's 2 held micro-batches on stage 0 (40 bytes) but not batched's 160
    tight = search(COSTS, 2, 4, Cluster(FREE, 100.0), SPACE)
    assert tight[0].feasible and not tight[0].setting.batch_weight_grads
    # fixed by the space: only unbatched
    fixed = search(COSTS, 2, 4, Cluster(FREE, math.inf), replace(SPACE, batch_weight_grads=(False,)))
    assert not any(c.setting.batch_weight_grads for c in fixed)


def test_batch_weight_grads_must_be_a_bool() -> None:
    with pytest.raises(Exception, match="batch_weight_grads must be True or False, got 1"):
        Setting(2, 1, 4, batch_weight_grads=1)  # type: ignore[arg-type]
