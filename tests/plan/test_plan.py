"""The plan is data: JSON round trip, printable summary, validation."""

from dataclasses import replace

import pytest

from plait.errors import ConfigError
from plait.plan import Plan


def plan():
    return Plan(layer_names=("a", "b", "c", "d"), layers_per_stage=(1, 3), num_microbatches=4,
                schedule="1f1b", world_size=2, capture_method="torch.export",
                tied_parameters=(("a.weight", (0, 1)),))


def test_json_round_trip():
    p = plan()
    assert Plan.from_json(p.to_json()) == p
    assert p.stage_to_rank == (0, 1)


def test_summary_names_stages_and_ties():
    text = str(plan())
    assert "stage 0 (rank 0): 1 layers: a" in text
    assert "stage 1 (rank 1): 3 layers: b, c, d" in text
    assert "tied parameter a.weight" in text


def test_bad_json_is_a_config_error():
    with pytest.raises(ConfigError, match="not a plait plan"):
        Plan.from_json('{"layer_names": ["a"]}')
    with pytest.raises(ConfigError, match="not a plait plan"):
        Plan.from_json("{truncated")


@pytest.mark.parametrize("field, value, message", [
    ("num_virtual_stages", 0, "num_virtual_stages=0"),
    ("dp", -1, "dp=-1"),
    ("layers_per_stage", [0, 4], "positive whole number"),
    ("uncuttable", [[1]], "not a plait plan"),
    ("num_microbatches", 1e400, "not a plait plan"),
    ("precision", "fp8", "precision='fp8'"),
])
def test_impossible_values_in_a_plan_file_are_config_errors(field, value, message):
    import json

    data = json.loads(plan().to_json())
    data[field] = value
    with pytest.raises(ConfigError, match=message):
        Plan.from_json(json.dumps(data))


def test_zero_and_kept_whole_round_trip_and_print() -> None:
    from plait.plan import Plan

    plan = Plan(layer_names=("a", "moe", "b"), layers_per_stage=(2, 1), num_microbatches=2, schedule="1f1b",
                world_size=4, capture_method="torch.export", dp=2, zero=1, kept_whole=("moe",))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    text = str(plan)
    assert "ZeRO-1: each stage's optimizer state sharded over its 2 replicas" in text
    assert "kept whole (one layer each, not traced into): moe" in text
    three = replace(plan, zero=3)
    assert "ZeRO-3: each stage's parameters, gradients and optimizer state sharded over its 2 replicas" in str(three)
    with pytest.raises(Exception, match="plan has zero=4; it must be 0, 1, 2 or 3"):
        Plan(layer_names=("a",), layers_per_stage=(1,), num_microbatches=1, schedule="1f1b", world_size=1,
             capture_method="torch.export", zero=4)


def test_tp_layouts_round_trip_and_print() -> None:
    layout = {"parameters": {"h.0.mlp.c_fc.weight": {"placement": "Shard(1)", "blocks": 1},
                             "h.0.attn.c_attn.weight": {"placement": "Shard(1)", "blocks": 3}},
              "collectives": [{"kind": "all_reduce", "pass": "forward", "at": "h.0.mlp.c_proj", "why": "g"},
                              {"kind": "all_reduce", "pass": "backward", "at": "h.0.mlp.c_fc", "why": "f"},
                              {"kind": "all_reduce", "pass": "forward", "at": "h.0.attn.c_proj", "why": "g"}],
              "replicated": {"h.1.attn.c_attn": "2 heads do not divide over tp=4"}}
    plan = Plan(layer_names=("a", "b"), layers_per_stage=(2,), num_microbatches=1, schedule="1f1b", world_size=2,
                capture_method="torch.export", tp=2, tp_layouts=(layout,))
    assert Plan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert "stage 0 split over tp=2: h.0.mlp.c_fc.weight: Shard(1); h.0.attn.c_attn.weight: Shard(1) in 3 blocks" in text
    assert "stage 0 collectives: 2 all_reduce in the forward, 1 all_reduce in the backward" in text
    assert "stage 0 replicated: h.1.attn.c_attn (2 heads do not divide over tp=4)" in text
    import json

    data = json.loads(plan.to_json())
    data["tp_layouts"] = [["a line"]]
    with pytest.raises(ConfigError, match="not a plait plan"):
        Plan.from_json(json.dumps(data))


# -- stages of different tp widths (stage_tp) ----------------------------------------------------

def widths(stage_tp=(2, 1), **fields):
    return Plan(**{"layer_names": ("a", "b", "c", "d"), "layers_per_stage": (1, 3), "num_microbatches": 2,
                   "schedule": "1f1b", "world_size": sum(stage_tp), "capture_method": "torch.export",
                   "stage_tp": stage_tp, **fields})


@pytest.mark.parametrize("stage_tp, ranks", [((2, 1), [[0, 1], [2]]), ((1, 2), [[0], [1, 2]]),
                                             ((1, 3), [[0], [1, 2, 3]])])
def test_stages_of_different_widths_take_the_ranks_in_stage_order(stage_tp, ranks) -> None:
    p = widths(stage_tp)
    assert p.tp == max(stage_tp) and [p.tp_of(s) for s in range(2)] == list(stage_tp)
    assert [[p.rank_of(s, 0, t) for t in range(p.tp_of(s))] for s in range(2)] == ranks
    for s, stage_ranks in enumerate(ranks):
        for t, r in enumerate(stage_ranks):
            assert p.position_of(r) == (s, 0) and p.tp_rank_of(r) == t and p.stages_of(r) == (s,)
    assert p.stage_to_rank == (0, ranks[1][0])
    assert Plan.from_json(p.to_json()) == p


def test_replicas_of_a_pipeline_of_different_widths_follow_one_another() -> None:
    """dp=2 at stage_tp=(2, 1): replica 0 on ranks 0 1 | 2, replica 1 on ranks 3 4 | 5."""
    p = widths((2, 1), dp=2, world_size=6, zero=1)
    assert [[[p.rank_of(s, r, t) for t in range(p.tp_of(s))] for s in range(2)] for r in range(2)] == [
        [[0, 1], [2]], [[3, 4], [5]]]
    assert [(p.position_of(r), p.tp_rank_of(r)) for r in range(6)] == [
        ((0, 0), 0), ((0, 0), 1), ((1, 0), 0), ((0, 1), 0), ((0, 1), 1), ((1, 1), 0)]
    text = str(p)
    assert "x 2 replica(s) x tp=[2, 1]" in text and "stage 0 (ranks 0-1, 3-4)" in text and "stage 1 (ranks 2, 5)" in text
    assert "sharded over its 2 replicas" in text and Plan.from_json(p.to_json()) == p
    with pytest.raises(ConfigError, match="rank 6 is not in the plan's 6 ranks"):
        p.position_of(6)


def test_stages_of_different_widths_print_their_ranks() -> None:
    text = str(widths())
    assert "x tp=[2, 1] (per stage, crossing as tiles) on 3 rank(s)" in text
    assert "stage 0 (ranks 0-1)" in text and "stage 1 (rank 2)" in text
    whole = widths(crossing="whole")
    assert "crossing as whole" in str(whole) and Plan.from_json(whole.to_json()) == whole


@pytest.mark.parametrize("stage_tp, fields, message", [
    ((2, 1, 1), {}, r"stage_tp=\[2, 1, 1\] for 2 stages"),
    ((2, 0), {}, r"stage_tp=\[2, 0\] for 2 stages; give one positive tp"),
    ((2, 1), {"world_size": 4}, r"stage_tp=\[2, 1\], 3 ranks in all, on world_size=4"),
    ((2, 1), {"dp": 2, "world_size": 3}, r"stage_tp=\[2, 1\] x dp=2, 6 ranks in all, on world_size=3"),
    ((2, 1, 2, 1), {"num_virtual_stages": 2, "layers_per_stage": (1, 1, 1, 1)}, "num_virtual_stages=2; .* no interl"),
    ((2, 1), {"tp": 4}, r"tp=4 and stage_tp=\[2, 1\]; tp is the widest stage's, 2"),
    ((2, 1), {"crossing": "gather"}, r"crossing='gather'; it must be one of \['tiles', 'whole'\]"),
])
def test_bad_stage_widths_are_named(stage_tp, fields, message) -> None:
    with pytest.raises(ConfigError, match=message):
        widths(stage_tp, **fields)


# -- stages of different dp widths (stage_dp) ----------------------------------------------------

def replicas(stage_dp=(2, 1), **fields):
    return Plan(**{"layer_names": ("a", "b", "c", "d"), "layers_per_stage": (1, 3), "num_microbatches": 2,
                   "schedule": "1f1b", "world_size": sum(stage_dp), "capture_method": "torch.export",
                   "stage_dp": stage_dp, **fields})


@pytest.mark.parametrize("stage_dp, ranks", [((2, 1), [[0, 1], [2]]), ((1, 2), [[0], [1, 2]]),
                                             ((3, 2), [[0, 1, 2], [3, 4]])])
def test_stages_of_different_dp_take_the_ranks_in_stage_order_one_per_replica(stage_dp, ranks) -> None:
    p = replicas(stage_dp)
    assert p.dp == 1 and p.tp == 1 and [p.dp_of(s) for s in range(2)] == list(stage_dp)
    assert [[p.rank_of(s, r) for r in range(p.dp_of(s))] for s in range(2)] == ranks
    for s, stage_ranks in enumerate(ranks):
        for replica, rank in enumerate(stage_ranks):
            assert p.position_of(rank) == (s, replica) and p.tp_rank_of(rank) == 0 and p.stages_of(rank) == (s,)
    assert p.stage_to_rank == (0, ranks[1][0])
    assert Plan.from_json(p.to_json()) == p
    with pytest.raises(ConfigError, match=rf"rank {sum(stage_dp)} is not in the plan's"):
        p.position_of(sum(stage_dp))


def test_stages_of_different_dp_print_their_replicas() -> None:
    text = str(replicas())
    assert "2 stage(s) x dp=[2, 1] (per stage) on 3 rank(s)" in text and "replica(s)" not in text
    assert "stage 0 (ranks 0, 1)" in text and "stage 1 (rank 2)" in text


@pytest.mark.parametrize("stage_dp, fields, message", [
    ((2, 1, 1), {}, r"stage_dp=\[2, 1, 1\] for 2 stages"),
    ((2, 0), {}, r"stage_dp=\[2, 0\] for 2 stages; give one positive dp"),
    ((2, 1), {"world_size": 4}, r"stage_dp=\[2, 1\], 3 ranks in all, on world_size=4"),
    ((2, 1), {"dp": 2}, "dp=2, tp=1"),
    ((2, 1), {"tp": 2}, "tp=2, num_virtual_stages=1"),
    ((1, 1), {"zero": 1, "world_size": 2}, r"stage_dp=\[1, 1\] with zero=1; ZeRO shards .* no stage has two"),
    ((2, 1), {"stage_tp": (2, 1)}, "stages differ in one width at a time"),
])
def test_bad_stage_dp_is_named(stage_dp, fields, message) -> None:
    with pytest.raises(ConfigError, match=message):
        replicas(stage_dp, **fields)


def test_stage_dp_shards_over_the_replicas_of_a_stage_that_has_them() -> None:
    assert replicas((2, 1), zero=2).zero == 2


def test_precision_round_trips_prints_and_old_plans_read_as_fp32() -> None:
    import dataclasses
    import json

    low = dataclasses.replace(plan(), precision="bf16")
    assert Plan.from_json(low.to_json()) == low
    assert "computed in bf16 over fp32 master weights" in str(low) and "computed in" not in str(plan())
    old = json.loads(plan().to_json())
    del old["precision"]  # a plan saved before plait computed in low precision
    assert Plan.from_json(json.dumps(old)).precision == "fp32"


def test_offload_travels_in_the_plan_and_needs_zero3():
    """zero=3's shards in host memory (the planner's choice or Config.offload) is the plan's to say."""
    p = replace(plan(), world_size=4, dp=2, zero=3, offload=True)
    assert Plan.from_json(p.to_json()) == p and Plan.from_json(plan().to_json()).offload is False
    assert "kept in host memory (offload)" in str(p)
    with pytest.raises(ConfigError, match="offload=True with zero=2; offload moves zero=3's shards"):
        replace(p, zero=2)
