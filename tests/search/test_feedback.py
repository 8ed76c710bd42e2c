"""Closing the loop: a run compared with its prediction, and a re-partition from measured times."""

from __future__ import annotations

import math

import pytest

from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster, Setting, partition_problem, predict
from plait.errors import ConfigError
from plait.search.feedback import compare, corrected_costs, should_replan
from plait.search.partition import optimal_partition
from tests.plan.factory import layer_costs

FREE = Network(Link(0.0, 1e30), Link(0.0, 1e30), 1)
SETTING = Setting(2, 1, 8, "1f1b")
CLUSTER = Cluster(FREE, math.inf)


def test_compare_and_decide() -> None:
    costs = layer_costs(8)  # F 1 + B 2 per row, 1 row per micro-batch: 3 s per layer
    pred = predict(costs, SETTING, CLUSTER, 8, (4, 4))
    close = compare(pred, [12.5, 11.9], pred.step_time_s * 1.05)
    assert [round(s.error, 3) for s in close.stages] == [round(0.5 / 12, 3), round(-0.1 / 12, 3)]
    assert not should_replan(close)
    far = compare(pred, [24.0, 12.0], pred.step_time_s * 1.6)
    assert should_replan(far) and far.worst_stage_error == pytest.approx(1.0)
    line = far.summary()
    assert "stage predicted/measured" in line and "0: 12000.0/24000.0 ms (+100%)" in line
    assert far.to_dict()["stages"][0]["measured_s"] == 24.0
    with pytest.raises(ConfigError, match="3 measured stage times for a layout of 2 stages"):
        compare(pred, [1.0, 2.0, 3.0], 1.0)


def test_a_slow_stage_gives_up_layers_after_correction() -> None:
    costs = layer_costs(8)
    pred = predict(costs, SETTING, CLUSTER, 8, (4, 4))
    fixed = corrected_costs(costs, pred, [24.0, 12.0])  # stage 0 runs at half the speed
    assert fixed.forward(1)[:4] == [2.0] * 4 and fixed.forward(1)[4:] == [1.0] * 4
    again = optimal_partition(partition_problem(fixed, SETTING, CLUSTER, 8))
    # layers 0-3 now take 6 s a micro-batch, 4-7 still 3 s: (3, 5) is 18 s on both stages
    assert again.layers_per_stage == (3, 5)
    assert "corrected" in fixed.source
