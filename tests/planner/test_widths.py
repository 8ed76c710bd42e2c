"""Tests for plait.planner.widths: Config() takes one pipeline of stages of different tp widths
only where it is predicted faster than every uniform layout and the config allows it."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

import plait
from plait.capture.trace import capture_batch
from plait.plan.cost import Cluster
from plait.plan.layer_costs import LayerCosts
from plait.plan.network import Link, Network
from plait.plan.search import SearchSpace
from plait.plan.tp_costs import search_tp
from plait.planner.autoplan import PlanResult
from plait.planner.profile import LayerProfile
from plait.planner.widths import mixed_widths_choice

BATCH = 8


def _setup(heavy: float):
    """A captured MLP (6 layers) whose first linear pair costs `heavy` a row, the rest 1e-6."""
    net = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 64))
    torch.manual_seed(0)
    captured = capture_batch(net, torch.randn(BATCH, 64))
    n = len(captured.layers.layer_names)
    row = tuple(heavy if i in (0, 2) else 1e-6 for i in range(n))
    zeros = (0.0,) * n
    costs = LayerCosts(captured.layers.layer_names, zeros, row, zeros, tuple(2 * r for r in row), zeros, zeros,
                       (4.0,) * n, (256.0,) * n, (5e7,) * n, (5e7,) * n, zeros)  # all-reduces cost 0.1 s a layer
    cluster = Cluster(Network(Link(1e-6, 1e9), Link(1e-6, 1e9), 8), math.inf)
    uniform = search_tp(costs, {}, 3, BATCH, cluster, SearchSpace(), degrees=(1,))
    profile = LayerProfile(costs, BATCH, 1, 1, 0.0, "test")
    return captured, PlanResult(uniform, profile, cluster, 3, BATCH), cluster


def test_a_heavy_pair_that_splits_gets_two_ranks_of_three() -> None:
    captured, result, cluster = _setup(1e-3)
    found = mixed_widths_choice(captured, plait.Config(), 3, result, cluster)
    assert found is not None
    fields, report = found
    assert sorted(fields["tp_per_stage"]) == [1, 2] and sum(fields["layers_per_proc"]) == 6
    assert report.predicted_step_s is not None and report.predicted_step_s < result.best.step_time_s
    assert len(report.predicted_stage_s) == len(fields["tp_per_stage"])
    assert "stages of different tp widths" in report.table
    config = dataclasses.replace(plait.Config(), **{**fields, "layers_per_proc": tuple(fields["layers_per_proc"])})
    assert config.tp_per_stage == tuple(fields["tp_per_stage"])  # a config the runtime takes


def test_not_where_the_config_asks_for_what_it_cannot_run_or_two_ranks() -> None:
    captured, result, cluster = _setup(1e-3)
    for config in (plait.Config(checkpoint_dir="ckpt"), plait.Config(tp=1), plait.Config(zero=1),
                   plait.Config(schedule="zbh1"), plait.Config(num_stages=2)):
        assert mixed_widths_choice(captured, config, 3, result, cluster) is None
    assert mixed_widths_choice(captured, plait.Config(), 2, result, cluster) is None


def test_recomputation_asked_for_is_what_the_widths_are_priced_with() -> None:
    captured, result, cluster = _setup(1e-3)
    # the uniform layouts as Config(recompute=True) searches them: recomputed too
    recomputed = search_tp(result.profile.costs, {}, 3, BATCH, cluster, SearchSpace(recompute=(True,)), degrees=(1,))
    found = mixed_widths_choice(captured, plait.Config(recompute=True), 3,
                                dataclasses.replace(result, candidates=recomputed), cluster)
    assert found is not None
    fields, report = found
    assert fields["recompute"] is True and report.chosen["recompute"] is True
    assert "recomputed" in report.table
    plain = mixed_widths_choice(captured, plait.Config(), 3, result, cluster)
    assert plain is not None and plain[0]["recompute"] is False  # memory is no object here
