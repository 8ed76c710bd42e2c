"""Tests for plait.planner.widths: Config() takes one pipeline of stages of different tp or dp widths
only where it is predicted faster than every uniform layout (and the other kind) and the config allows it."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

import plait
from plait.capture.trace import capture_batch
from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster
from plait.plan.layer_costs import LayerCosts
from plait.planner.autoplan import PlanResult
from plait.planner.profile import LayerProfile
from plait.planner.widths import mixed_widths_choice
from plait.search.dp_widths import search_dp_widths
from plait.search.search import SearchSpace
from plait.search.tp_degree import search_tp

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
    assert sorted(fields["stage_tp"]) == [1, 2] and sum(fields["layers_per_stage"]) == 6
    assert report.predicted_step_s is not None and report.predicted_step_s < result.best.step_time_s
    assert len(report.predicted_stage_s) == len(fields["stage_tp"])
    assert "stages of different tp widths" in report.table
    config = dataclasses.replace(plait.Config(), **{**fields, "layers_per_stage": tuple(fields["layers_per_stage"])})
    assert config.stage_tp == tuple(fields["stage_tp"])  # a config the runtime takes


def test_not_where_the_config_asks_for_what_it_cannot_run_or_two_ranks() -> None:
    captured, result, cluster = _setup(1e-3)
    for config in (plait.Config(replan=True), plait.Config(tp=1), plait.Config(zero=1),
                   plait.Config(schedule="zbh1"), plait.Config(num_stages=2)):
        assert mixed_widths_choice(captured, config, 3, result, cluster) is None
    # checkpoints of stages of different widths are written and read (tests/test_cross_mesh_checkpoint.py)
    assert mixed_widths_choice(captured, plait.Config(checkpoint_dir="ckpt"), 3, result, cluster) is not None
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


# -- stages of different dp widths ------------------------------------------------------------------

def _embedding_like(grad_bytes: float = 3e8):
    """A captured LayerNorm -> Linear -> ReLU -> Linear (4 layers) priced so that one pipeline of a
    replicated stage must win at 4 rows on 3 ranks: the LayerNorm (which tp does not split) takes
    0.03 s a row and has no gradients; the rest is nearly free but holds `grad_bytes` of gradients a
    layer, which any stage of replicas all-reduces. Returns (net, captured, costs)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    captured = capture_batch(net, torch.randn(4, 8))
    names = captured.layers.layer_names
    zeros = (0.0,) * len(names)
    row = (0.01, 1e-5, 1e-5, 1e-5)
    grads = (0.0, grad_bytes, grad_bytes, grad_bytes)
    costs = LayerCosts(names, zeros, row, zeros, tuple(2 * r for r in row), zeros, zeros, (64.0,) * 4, (32.0,) * 4,
                       (1e3,) * 4, grads, zeros, input_row_bytes=32.0)
    return net, captured, costs


def test_a_heavy_layer_without_gradients_gets_two_replicas() -> None:
    # pp=3 runs the LayerNorm on all 4 rows (0.12 s); dp=3 and the replicated stage run 2 rows each
    # (0.06 s), but dp=3 all-reduces 0.9 GB; stage 0 = the LayerNorm on ranks 0 1, stage 1 the rest
    _, captured, costs = _embedding_like()
    cluster = Cluster(Network(Link(1e-5, 1e9), Link(1e-5, 1e9), 8), 2**34)
    uniform = search_tp(costs, {}, 3, 4, cluster, SearchSpace(), degrees=(1,))
    result = PlanResult(uniform, LayerProfile(costs, 4, 1, 1, 0.0, "test"), cluster, 3, 4)
    found = mixed_widths_choice(captured, plait.Config(), 3, result, cluster)
    assert found is not None
    fields, report = found
    assert (fields["stage_dp"], fields["layers_per_stage"]) == ([2, 1], [1, 3]) and "stage_tp" not in fields
    assert fields["num_microbatches"] in (1, 2)  # 4 or 2 rows a micro-batch: each divides by 2
    assert report.predicted_step_s is not None and report.predicted_step_s < result.best.step_time_s
    assert report.chosen["stages"][0]["mesh"] == {"dp": 2, "tp": 1} and "stages of different dp widths" in report.table
    config = dataclasses.replace(plait.Config(), **{**fields, "layers_per_stage": tuple(fields["layers_per_stage"])})
    assert config.stage_dp == (2, 1) and config.lanes(3) == 2  # a config the runtime takes
    assert mixed_widths_choice(captured, plait.Config(schedule="gpipe"), 3, result, cluster)[0]["schedule"] == "gpipe"
    for refused in (plait.Config(zero=1), plait.Config(grad_reduction="sum"), plait.Config(num_stages=2),
                    plait.Config(replan=True)):
        assert mixed_widths_choice(captured, refused, 3, result, cluster) is None


def test_the_faster_of_the_tp_and_the_dp_widths_is_taken() -> None:
    # the heavy linear pair of `_setup` splits over tp; replicating it all-reduces its 0.1 s a layer
    captured, result, cluster = _setup(1e-3)
    dp = search_dp_widths(result.profile.costs, 3, BATCH, cluster)
    assert dp is not None and dp.step_time_s > result.best.step_time_s  # found, and slower than uniform
    fields, _ = mixed_widths_choice(captured, plait.Config(), 3, result, cluster)
    assert "stage_tp" in fields


def test_the_training_loss_reaches_each_widths_pricing(monkeypatch) -> None:
    # a split last stage's loss is priced as it runs (`tp_shares` with the loss and targets)
    from plait.planner import widths

    captured, result, cluster = _setup(1e-3)
    seen = []
    real = widths.tp_shares

    def spy(c, w, plan=None, loss=None, target=None):
        seen.append((loss, target))
        return real(c, w, plan, loss, target)

    monkeypatch.setattr(widths, "tp_shares", spy)
    y = torch.randn(BATCH, 64)
    assert mixed_widths_choice(captured, plait.Config(), 3, result, cluster, nn.functional.mse_loss, y) is not None
    assert seen and all(loss is nn.functional.mse_loss and target is y for loss, target in seen)


def test_copies_of_a_pipeline_of_widths_are_searched_and_run_as_config_fields(monkeypatch, tmp_path) -> None:
    """On 6 ranks the tp-width search also prices 2 and 3 copies of a pipeline; a choice of 2 copies
    of widths (2, 1) becomes Config(stage_tp=(2, 1), dp=2) on 6 ranks, and its saved report
    replays it."""
    import plait.search.width_search as width_search
    from plait.planner.replay import load_plan_file
    from plait.search.width_search import MixedWidths

    captured, result, cluster = _setup(1e-3)
    asked = []
    copies = MixedWidths((3, 3), (2, 1), 2, "1f1b", 0.001, 0.001, (5e-4, 5e-4), dp=2, allreduce_s=(1e-5, 1e-5))

    def priced(*args, replicas=(1,), **kwargs):
        asked.append(tuple(replicas))
        return copies

    monkeypatch.setattr(width_search, "search_widths", priced)  # the one search `plait plan` runs too
    monkeypatch.setattr(width_search, "search_dp_widths", lambda *args, **kwargs: None)
    six = dataclasses.replace(result, world_size=6)
    found = mixed_widths_choice(captured, plait.Config(), 6, six, cluster)
    assert asked == [(1, 2, 3)] and found is not None
    fields, report = found
    assert (fields["stage_tp"], fields["dp"], fields["layers_per_stage"]) == ([2, 1], 2, [3, 3])
    assert report.chosen["dp"] == 2 and "x dp=2 copies of the pipeline" in report.table
    config = dataclasses.replace(plait.Config(), **{**fields, "layers_per_stage": tuple(fields["layers_per_stage"])})
    assert config.lanes(6) == 4 and config.stages_for(config.lanes(6)) == 2  # a config 6 ranks run
    report.save(tmp_path / "plan.json")
    replayed = load_plan_file(str(tmp_path / "plan.json"), captured.layers.layer_names, 6)[0]
    assert (replayed["stage_tp"], replayed["dp"]) == ([2, 1], 2)


# -- one search for `plait plan` and Config() -------------------------------------------------------

def _plan_args(devices: int, **given):
    """`plait plan`'s options as the command parses them with none given but --devices."""
    import argparse

    return argparse.Namespace(**{"layout": None, "devices": devices, "tp": None, "pp": None, "zero": None,
                                 "microbatches": None, "schedules": None, "recompute": (False, True), "top": 5, "precision": "fp32",
                                 **given})


def test_plait_plan_and_config_choose_the_same_stages_of_different_widths() -> None:
    """Issue #45: `plait plan` searched stage widths by its own calls and limits (tp widths up to 64
    devices, dp widths up to 16 and 128 layers), `Config()` by others (3-16 ranks); both now run
    `search_stage_widths`. On the same costs, graph and world they find the same layout."""
    from plait.cli.plan_command import _model_widths

    captured, result, cluster = _setup(1e-3)  # tp widths win
    fields, _ = mixed_widths_choice(captured, plait.Config(), 3, result, cluster)
    shown = _model_widths(_plan_args(3), captured, result, cluster).tp
    assert shown is not None and (fields["stage_tp"], fields["layers_per_stage"], fields["dp"]) == (
        list(shown.widths), list(shown.layers_per_stage), shown.dp)
    assert (fields["num_microbatches"], fields["schedule"], fields["recompute"], fields["crossing"]) == (
        shown.num_microbatches, shown.schedule, shown.recompute, shown.crossing)
    _, captured, costs = _embedding_like()  # dp widths win
    cluster = Cluster(Network(Link(1e-5, 1e9), Link(1e-5, 1e9), 8), 2**34)
    uniform = search_tp(costs, {}, 3, 4, cluster, SearchSpace(), degrees=(1,))
    result = PlanResult(uniform, LayerProfile(costs, 4, 1, 1, 0.0, "test"), cluster, 3, 4)
    fields, _ = mixed_widths_choice(captured, plait.Config(), 3, result, cluster)
    shown_dp = _model_widths(_plan_args(3), captured, result, cluster).dp
    assert shown_dp is not None and (fields["stage_dp"], fields["layers_per_stage"], fields["num_microbatches"],
                                     fields["schedule"], fields["recompute"]) == (
        list(shown_dp.dp), list(shown_dp.layers_per_stage), shown_dp.num_microbatches, shown_dp.schedule,
        shown_dp.recompute)


def test_plait_plan_and_config_search_the_same_worlds_with_the_same_inputs(monkeypatch) -> None:
    """Each pass runs on the same worlds for both callers, the `WIDTH_LIMITS` ones (before: tp widths
    on 17-64 devices in `plait plan` only), asked the same widths, micro-batches, schedules and
    recomputation."""
    import plait.search.width_search as width_search
    from plait.cli.plan_command import _model_widths
    from plait.search.width_search import WIDTH_LIMITS

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # Config(): every rank on this host
    captured, result, cluster = _setup(1e-3)
    asked: list[tuple] = []
    monkeypatch.setattr(width_search, "search_widths", lambda costs, shares, world, rows, cluster, degrees, m,
                        recompute, schedules, replicas: asked.append(("tp", world, degrees, m, tuple(recompute),
                                                                      tuple(schedules), tuple(replicas))))
    monkeypatch.setattr(width_search, "search_dp_widths", lambda costs, world, rows, cluster, space, beat: asked.append(
        ("dp", world, space.num_microbatches, tuple(space.recompute), tuple(space.schedules))))
    worlds = (2, 3, 16, 17, 64, 65)
    by_caller = {}
    for caller in ("plan", "config"):
        asked.clear()
        for world in worlds:
            if caller == "plan":
                _model_widths(_plan_args(world), captured, result, cluster)
            else:
                mixed_widths_choice(captured, plait.Config(), world, result, cluster)
        by_caller[caller] = list(asked)
    assert by_caller["plan"] == by_caller["config"]
    assert [w for kind, w, *_ in by_caller["plan"] if kind == "tp"] == [3, 16, 17, 64]
    assert [w for kind, w, *_ in by_caller["plan"] if kind == "dp"] == [3, 16]
    n = result.profile.costs.num_layers
    assert all(WIDTH_LIMITS.allow(w, n, kind == "dp") for kind, w, *_ in by_caller["plan"])
