"""Tests for plait.planner.resolve: a run's config becomes a complete Plan (cut, sizes, recomputation),
so that pipeline assembly decides nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.capture.trace import capture_batch
from plait.config import Config
from plait.planner.resolve import layout_keys, recomputed_stages, resolve_plan


def net_and_graph():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    return net, capture_batch(net, torch.randn(6, 4))


def test_one_process_is_one_stage_of_every_layer_with_the_defaults_filled():
    net, graph = net_and_graph()
    plan = resolve_plan(Config(), 1, graph, net)
    assert plan.layers_per_stage == (len(graph.layers.layer_names),)
    assert (plan.num_stages, plan.dp, plan.num_microbatches, plan.schedule, plan.recompute) == (1, 1, 1, "1f1b", ())
    assert plan.capture_method == graph.method and plan.layer_names == tuple(graph.layers.layer_names)


def test_a_given_cut_is_kept_and_the_sizes_come_from_the_config():
    net, graph = net_and_graph()
    n = len(graph.layers.layer_names)
    config = Config(layers_per_stage=(2, n - 2), dp=2, num_microbatches=4, schedule="gpipe", recompute=True)
    plan = resolve_plan(config, 4, graph, net)
    assert plan.layers_per_stage == (2, n - 2)
    assert (plan.num_stages, plan.dp, plan.world_size, plan.num_microbatches, plan.schedule) == (2, 2, 4, 4, "gpipe")
    assert plan.recompute == (0, 1)


def test_split_points_become_the_layer_counts_of_their_cut():
    net, graph = net_and_graph()  # layers "0".."4"
    plan = resolve_plan(Config(split_points=["2"], num_microbatches=2), 2, graph, net)
    assert plan.layers_per_stage == (2, 3) and plan.stage_layers(1) == ("2", "3", "4")
    with pytest.raises(plait.PartitionError, match=r"split point '7' \(split_points=\['7'\]\) matches no captured layer"):
        resolve_plan(Config(split_points=["7"]), 2, graph, net)


def test_without_a_cut_the_layers_are_balanced_by_parameters():
    net, graph = net_and_graph()  # the 64 x 64 layer in the middle outweighs the others
    plan = resolve_plan(Config(num_stages=2), 2, graph, net)
    assert sum(plan.layers_per_stage) == len(graph.layers.layer_names) and plan.num_stages == 2
    first = plan.stage_layers(0)
    assert any(name.startswith("2") for name in first) != any(name.startswith("2") for name in plan.stage_layers(1))


def test_interleaving_cuts_num_stages_x_v_chunks():
    net, graph = net_and_graph()
    plan = resolve_plan(Config(num_stages=2, schedule="interleaved", num_virtual_stages=2), 2, graph, net)
    assert (plan.num_stages, plan.num_chunks, plan.num_virtual_stages) == (2, 4, 2)


def test_more_chunks_than_layers_is_an_error_naming_both():
    net, graph = net_and_graph()
    n = len(graph.layers.layer_names)
    with pytest.raises(plait.PartitionError, match=rf"{n + 1} stages \({n + 1} ranks x num_virtual_stages=1\) "
                                                   rf"but the model has only {n} layers"):
        resolve_plan(Config(num_stages=n + 1), n + 1, graph, net)


@pytest.mark.parametrize("schedule, stages, m, want", [
    ("1f1b", 4, 8, (0, 1, 2)),   # stage s holds min(p - s, m) micro-batches: the last holds one
    ("1f1b", 4, 2, (0, 1, 2)),   # stages 0-2 hold 2 at once, stage 3 one
    ("gpipe", 3, 4, (0, 1, 2)),  # GPipe holds all m on every stage
    ("gpipe", 3, 1, ()),         # one micro-batch: nothing to save
    ("1f1b", 2, 1, ()),
])
def test_auto_recomputes_the_stages_that_hold_more_than_one_microbatch(schedule, stages, m, want):
    assert recomputed_stages("auto", schedule, m, stages, 1) == want


def test_recompute_lists_and_errors():
    assert recomputed_stages(plait.Config(recompute=[2, 0, 2]).recompute, "1f1b", 1, 3, 1) == (0, 2)
    assert recomputed_stages(True, "1f1b", 1, 3, 1) == (0, 1, 2)
    assert recomputed_stages(False, "1f1b", 1, 3, 1) == () == recomputed_stages(None, "1f1b", 1, 3, 1)
    assert recomputed_stages([2, 0], "1f1b", 1, 3, 1) == (0, 2)  # a saved plan's stages (JSON)
    with pytest.raises(plait.ConfigError, match=r"names stages \[3\], but the model has 3 stages"):
        recomputed_stages((3,), "1f1b", 1, 3, 1)


def test_the_planners_zero_level_reaches_the_plan():
    # the planner's answer is a candidate (its JSON, read by its layout keys), ZeRO included (plait.planner.layout)
    net, graph = net_and_graph()
    n = len(graph.layers.layer_names)
    chosen = {"pp": 2, "dp": 2, "num_microbatches": 4, "schedule": "1f1b", "recompute": False, "zero": 2,
              "layers_per_stage": [2, n - 2], "feasible": True, "predicted_step_time_s": 0.5}
    assert layout_keys(chosen) == {k: v for k, v in chosen.items() if k not in ("feasible", "predicted_step_time_s")}
    plan = resolve_plan(Config(), 4, graph, net, chosen)  # the choice over the user's open Config
    assert plan.zero == 2 and plan.dp == 2 and plan.pp == 2 and plan.layers_per_stage == (2, n - 2)
    given = Config(num_stages=2, dp=2, num_microbatches=4, layers_per_stage=(2, n - 2), zero=2)
    assert resolve_plan(given, 4, graph, net) == plan  # the same layout given whole
    assert resolve_plan(Config(), 4, graph, net, {**chosen, "zero": None}).zero == 0  # not planned: 0
    with pytest.raises(plait.ConfigError, match="set dp > 1 or zero=0"):
        resolve_plan(Config(layers_per_stage=(2, 1, 1, n - 4), zero=1), 4, graph, net)
    with pytest.raises(plait.ConfigError, match="set dp > 1 or zero=0"):  # a candidate's too
        resolve_plan(Config(), 4, graph, net, {**chosen, "pp": 4, "dp": 1, "layers_per_stage": [2, 1, 1, n - 4]})


def test_the_choice_fills_what_the_users_config_leaves_open():
    """resolve_plan(config, ..., chosen): the candidate's layout (JSON lists) over what the user's
    Config leaves open; the user's settings beside the layout stay, and a choice of tp=1 drops the
    tp plan."""
    net, graph = net_and_graph()
    n = len(graph.layers.layer_names)
    user = Config(recompute_by_layer=False, tp_plan={"*": "replicate"})
    chosen = {"layers_per_stage": [2, n - 2], "pp": 2, "dp": 1, "num_microbatches": 3, "schedule": "gpipe",
              "recompute": [1], "tp": 1}
    plan = resolve_plan(user, 2, graph, net, chosen)
    assert (plan.layers_per_stage, plan.num_microbatches, plan.schedule, plan.recompute) == ((2, n - 2), 3, "gpipe", (1,))
    assert plan.recompute_by_layer == () and plan.tp_plan == ()
    assert resolve_plan(Config(layers_per_stage=(2, n - 2)), 2, graph, net, {}) == resolve_plan(
        Config(layers_per_stage=(2, n - 2)), 2, graph, net)  # nothing chosen: the config as given


def test_a_candidate_is_read_into_the_plan_and_never_becomes_a_config(monkeypatch):
    """The layout's forms: search space -> candidate -> Plan. No Config is made of the candidate's
    layout on its way (the user's Config, with its defaults, is the only one resolve_plan reads)."""
    net, graph = net_and_graph()
    n = len(graph.layers.layer_names)
    made: list[Config] = []
    check = Config.__post_init__
    monkeypatch.setattr(Config, "__post_init__", lambda self: (made.append(self), check(self))[1])
    chosen = {"pp": 2, "dp": 2, "num_microbatches": 4, "schedule": "gpipe", "layers_per_stage": [3, n - 3]}
    plan = resolve_plan(Config(), 4, graph, net, chosen)
    assert (plan.pp, plan.dp, plan.num_microbatches, plan.schedule) == (2, 2, 4, "gpipe")
    assert plan.layers_per_stage == (3, n - 3) and made  # the user's Config was made (and its defaults)
    assert all(c.layers_per_stage is None and c.num_stages is None and c.dp in (None, 1) for c in made)


def test_offload_comes_from_the_candidate_or_the_users_config():
    net, graph = net_and_graph()
    n = len(graph.layers.layer_names)
    chosen = {"pp": 1, "dp": 2, "zero": 3, "offload": True, "layers_per_stage": [n]}
    assert resolve_plan(Config(), 2, graph, net, chosen).offload is True
    assert resolve_plan(Config(), 2, graph, net, {**chosen, "offload": False}).offload is False
    assert resolve_plan(Config(num_stages=1, dp=2, zero=3, offload="optimizer"), 2, graph, net).offload is True
    assert resolve_plan(Config(num_stages=1, dp=2, zero=3, offload=False), 2, graph, net).offload is False
