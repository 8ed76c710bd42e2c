"""Tests for plait.planner.replay: plan files and resumed checkpoints replay their layout, checked against the run."""

from __future__ import annotations

import dataclasses
import json

import pytest

import plait
from plait.planner.replay import load_plan_file, resumed_fields


def test_plan_files_that_do_not_fit_say_what_and_where(tmp_path):
    names = tuple(str(i) for i in range(11))
    plan = {"pp": 2, "dp": 1, "num_microbatches": 2, "schedule": "1f1b", "num_virtual_stages": 1,
            "recompute": False, "layers_per_stage": [5, 6], "feasible": True, "stages": []}
    good = tmp_path / "good.json"
    good.write_text(json.dumps(plan))
    fields, _ = load_plan_file(str(good), names, 2)
    assert fields["layers_per_stage"] == [5, 6] and fields["num_microbatches"] == 2
    with pytest.raises(plait.ConfigError, match=r"good.json.*for 2 ranks but the world size is 4"):
        load_plan_file(str(good), names, 4)
    with pytest.raises(plait.ConfigError, match=r"good.json.*cuts 11 layers.*this model has 12"):
        load_plan_file(str(good), names + ("11",), 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(plait.ConfigError, match=r"bad.json.*not JSON"):
        load_plan_file(str(bad), names, 2)
    with pytest.raises(plait.ConfigError, match=r"missing.json.*cannot read"):
        load_plan_file(str(tmp_path / "missing.json"), names, 2)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"layer_names": [f"x{i}" for i in range(11)], "layers_per_stage": [5, 6],
                                 "num_microbatches": 1, "schedule": "1f1b", "world_size": 2,
                                 "capture_method": "torch.export"}))
    with pytest.raises(plait.ConfigError, match=r"other.json.*another model"):
        load_plan_file(str(other), names, 2)
    with pytest.raises(plait.ConfigError, match="keep one of them"):
        plait.Config(plan=str(good), layers_per_stage=[5, 6])


def test_plan_files_carry_zero_and_old_ones_read_as_zero_0(tmp_path):
    names = tuple(str(i) for i in range(11))
    plan = {"pp": 1, "dp": 2, "num_microbatches": 2, "schedule": "1f1b", "num_virtual_stages": 1,
            "recompute": False, "layers_per_stage": [11], "feasible": True, "stages": []}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(plan))
    assert load_plan_file(str(old), names, 2)[0]["zero"] == 0  # saved before the planner priced ZeRO
    new = tmp_path / "new.json"
    new.write_text(json.dumps({**plan, "zero": 2}))
    assert load_plan_file(str(new), names, 2)[0]["zero"] == 2
    saved = tmp_path / "saved_plan.json"  # Plan.to_json()
    saved.write_text(plait.Plan(layer_names=names, layers_per_stage=(11,), num_microbatches=2, schedule="1f1b",
                                world_size=2, capture_method="torch.export", dp=2, zero=1).to_json())
    assert load_plan_file(str(saved), names, 2)[0]["zero"] == 1


def test_plan_files_of_stages_of_different_widths_replay_them(tmp_path):
    """A saved report of a pipeline of uneven widths (as `plait.planner.widths` writes its choice) and
    such a Plan.to_json() give Config fields for that pipeline, on the ranks the widths add up to."""
    names = tuple(str(i) for i in range(11))
    chosen = {"pp": 2, "dp": 1, "tp": 1, "stage_tp": [2, 1], "crossing": "whole", "num_microbatches": 2,
              "schedule": "gpipe", "num_virtual_stages": 1, "recompute": True, "zero": 0,
              "batch_weight_grads": False, "layers_per_stage": [5, 6], "feasible": True,
              "stages": [{"stage": s, "tp": w, "num_layers": n, "first_layer": 5 * s, "time_s": 0.1}
                         for s, (w, n) in enumerate(((2, 5), (1, 6)))]}  # no memory per stage: not priced
    report = tmp_path / "report.json"
    report.write_text(json.dumps(chosen))
    fields, replayed = load_plan_file(str(report), names, 3)
    assert (fields["stage_tp"], fields["crossing"], fields["layers_per_stage"]) == ([2, 1], "whole", [5, 6])
    assert replayed is not None and "stage_tp=[2, 1]" in replayed.table
    assert "stage  1: 6 layers from 5  F+B+W 100.000 ms" in replayed.table
    with pytest.raises(plait.ConfigError, match="the plan is for 3 ranks but the world size is 2"):
        load_plan_file(str(report), names, 2)
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({**{k: v for k, v in chosen.items() if k not in ("stage_tp", "crossing")},
                                "stage_dp": [1, 3]}))
    fields = load_plan_file(str(rows), names, 4)[0]
    assert fields["stage_dp"] == [1, 3] and "crossing" not in fields
    saved = tmp_path / "saved_plan.json"  # Plan.to_json()
    saved.write_text(plait.Plan(layer_names=names, layers_per_stage=(5, 6), num_microbatches=2, schedule="1f1b",
                                world_size=3, capture_method="torch.export", stage_tp=(1, 2)).to_json())
    fields = load_plan_file(str(saved), names, 3)[0]
    assert (fields["stage_tp"], fields["crossing"], fields["dp"]) == ([1, 2], "tiles", 1)
    copies = tmp_path / "copies.json"  # two replicas of that pipeline
    copies.write_text(dataclasses.replace(plait.Plan.from_json(saved.read_text()), dp=2, world_size=6).to_json())
    assert load_plan_file(str(copies), names, 6)[0]["dp"] == 2
    config = dataclasses.replace(plait.Config(), **{**fields, "layers_per_stage": tuple(fields["layers_per_stage"]),
                                                   "recompute": tuple(fields["recompute"])})
    assert config.stage_tp == (1, 2) and config.lanes(3) == 2  # a config the runtime takes


def test_a_resume_on_the_same_world_keeps_the_checkpoints_cut_instead_of_replanning():
    names = tuple(f"l{i}" for i in range(9))
    saved = {"world_size": 4, "layer_names": list(names), "layers_per_stage": [6, 3], "dp": 2,
             "num_virtual_stages": 1, "num_microbatches": 3, "schedule": "gpipe", "recompute": []}
    assert resumed_fields(saved, plait.Config(), 4, names) == {
        "layers_per_stage": [6, 3], "pp": 2, "dp": 2, "num_microbatches": 3, "schedule": "gpipe",
        "num_virtual_stages": 1, "recompute": [], "recompute_by_layer": [], "zero": 0,
        "batch_weight_grads": False, "offload": False}  # the planner chose everything: all of it is kept
    by_layer = {**saved, "recompute": [0, 1], "recompute_by_layer": [1]}
    assert resumed_fields(by_layer, plait.Config(), 4, names)["recompute_by_layer"] == [1]
    assert resumed_fields({**saved, "zero": 2}, plait.Config(), 4, names)["zero"] == 2  # and its ZeRO
    fixed = plait.Config(num_stages=2, dp=2, num_microbatches=3)
    # only the cut (and ZeRO, a checkpoint saved before plait priced it: 0) was planned
    assert resumed_fields(saved, fixed, 4, names) == {"layers_per_stage": [6, 3], "zero": 0, "offload": False}
    one_replica = {**saved, "layers_per_stage": [3, 3, 2, 1], "dp": 1}
    assert resumed_fields(one_replica, plait.Config(zero=1), 4, names) is None  # ZeRO needs replicas
    assert resumed_fields(saved, plait.Config(num_stages=4, dp=1), 4, names) is None  # config says otherwise
    assert resumed_fields(saved, fixed, 8, names) is None  # another world: planned afresh
    assert resumed_fields(saved, fixed, 4, names[:-1] + ("other",)) is None  # another model
    assert resumed_fields({**saved, "layers_per_stage": "x"}, fixed, 4, names) is None  # damaged meta
