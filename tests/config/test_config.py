"""Tests for plait.config: defaults, what is planned, stages for a world size, the JSON round trip,
and errors naming the bad value (more of them: tests/test_model.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from plait.config import Config
from plait.plan.execution import NONFINITE_ACTIONS
from plait.schedule.registry import SCHEDULE_NAMES, SEARCH_ORDER
from plait.errors import ConfigError


def test_defaults_leave_the_layout_to_the_planner() -> None:
    config = Config()
    assert (config.layers_per_stage, config.num_stages, config.dp, config.num_microbatches, config.schedule,
            config.recompute, config.plan) == (None,) * 7
    assert (config.num_virtual_stages, config.seed, config.timeout_s, config.grad_reduction, config.bucket_cap_mb,
            config.checkpoint_keep, config.on_nonfinite, config.replan, config.batch_weight_grads) == (
        1, 0, 300.0, "mean", 25.0, 2, "stop", None, None)  # replan: as `plait run --replan` says; batched W: planned
    assert config.plans_everything
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved", "zbh1")
    assert sorted(SEARCH_ORDER) == sorted(SCHEDULE_NAMES) and SEARCH_ORDER[0] == "1f1b"
    assert NONFINITE_ACTIONS == ("stop", "skip", "ignore")


@pytest.mark.parametrize("size", [{"layers_per_stage": [1, 1]}, {"split_points": ["h.1"]}, {"num_stages": 2}, {"dp": 1},
                                  {"num_microbatches": 4}, {"plan": "plan.json"}])
def test_any_size_given_means_the_planner_does_not_choose_everything(size: dict) -> None:
    assert not Config(**size).plans_everything


def test_not_sizes_leave_everything_to_the_planner() -> None:
    assert Config(schedule="gpipe", recompute=True, seed=3, trace_dir="t").plans_everything


def test_with_defaults_fills_only_what_is_open() -> None:
    assert dataclasses.astuple(Config().with_defaults()) == dataclasses.astuple(
        Config(dp=1, num_microbatches=1, schedule="1f1b", recompute=False, tp=1, batch_weight_grads=False))
    assert Config(batch_weight_grads=True).with_defaults().batch_weight_grads is True
    given = Config(dp=2, num_microbatches=8, schedule="gpipe", recompute="auto").with_defaults()
    assert (given.dp, given.num_microbatches, given.schedule, given.recompute) == (2, 8, "gpipe", "auto")


def test_replan_is_not_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Options of `plait run` are applied in one place (plait.config.run_options), not by Config.
    monkeypatch.setenv("PLAIT_REPLAN", "1")
    assert Config().replan is None and Config(replan=False).replan is False
    with pytest.raises(ConfigError, match="replan must be True, False or None"):
        Config(replan="yes")


def test_lists_and_paths_are_normalised(tmp_path: Path) -> None:
    config = Config(layers_per_stage=[2, 3], recompute=[1], trace_dir=tmp_path / "t", checkpoint_dir=tmp_path / "c")
    assert config.layers_per_stage == (2, 3) and config.recompute == (1,)
    assert (config.trace_dir, config.checkpoint_dir) == (str(tmp_path / "t"), str(tmp_path / "c"))
    assert Config(plan=tmp_path / "p.json").plan == str(tmp_path / "p.json")
    assert Config(split_points=["h.1", "ln_f"]).split_points == ("h.1", "ln_f")


def test_a_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().seed = 1  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    ({"layers_per_stage": "2,3"}, "layers_per_stage must be a list of layer counts, one per stage, got '2,3'; "
                                 "for example layers_per_stage=[2, 3, 3]"),
    ({"layers_per_stage": []}, "layers_per_stage=[] must hold one positive integer per stage (bad entries: []); "
                              "every stage needs at least one layer"),
    ({"layers_per_stage": [2, True]}, "layers_per_stage=[2, True] must hold one positive integer per stage "
                                     "(bad entries: [True]); every stage needs at least one layer"),
    ({"layers_per_stage": [1, 1, 1, 1], "schedule": "interleaved", "num_virtual_stages": 2, "num_stages": 3},
     "num_stages=3 x num_virtual_stages=2 = 6 chunks but layers_per_stage=[1, 1, 1, 1] has 4 entries; "
     "make them agree"),
    ({"split_points": "h.1"}, "split_points must be a list of module names, each starting a new stage, got "
                              "'h.1'; for example split_points=['model.layers.6'] (names as in net.named_modules())"),
    ({"split_points": ["h.1", ""]}, "split_points=['h.1', ''] must hold module names, non-empty strings as in "
                                    "net.named_modules() (bad entries: [''])"),
    ({"split_points": ["h.1", 2]}, "split_points=['h.1', 2] must hold module names, non-empty strings as in "
                                   "net.named_modules() (bad entries: [2])"),
    ({"split_points": ["h.1", "h.1"]}, "split_points=['h.1', 'h.1'] names ['h.1'] more than once; each name "
                                       "starts one stage: list it once"),
    ({"split_points": ["h.1"], "layers_per_stage": [8, 8]},
     "split_points=['h.1'] and layers_per_stage=[8, 8] both give the cut; keep one of them (split_points names "
     "the module each stage after the first starts at, layers_per_stage counts the layers of each stage)"),
    ({"split_points": ["h.1"], "plan": "plan.json"},
     "plan='plan.json' and split_points=['h.1'] both give the layers of each stage; keep one of them"),
    ({"split_points": ["h.1"], "num_stages": 3},
     "num_stages=3 but split_points=['h.1'] cut 2 stages (one more than the points); give one of them, "
     "or name 2 points"),
    ({"split_points": ["h.1"], "schedule": "interleaved", "num_virtual_stages": 2, "num_stages": 2},
     "num_stages=2 x num_virtual_stages=2 = 4 chunks but split_points=['h.1'] cut 2; name 3 points, "
     "or make num_stages agree"),
    ({"split_points": ["h.1", "ln_f"], "schedule": "interleaved", "num_virtual_stages": 2},
     "split_points=['h.1', 'ln_f'] cut the model into 3 chunks, not a multiple of num_virtual_stages=2; "
     "with interleaving name num_stages x 2 - 1 points"),
    ({"num_stages": 0}, "num_stages must be a positive integer or None, got 0"),
    ({"num_microbatches": True}, "num_microbatches must be a positive integer, got True"),
    ({"num_virtual_stages": 2, "schedule": "gpipe"}, "num_virtual_stages=2 needs schedule='interleaved', "
                                                     "got schedule='gpipe'"),
    ({"recompute": 1.5}, "recompute=1.5 is not known; use True, False, 'auto' or a list of stage indices"),
    ({"trace_dir": 3}, "trace_dir must be a directory path or None, got 3"),
    ({"dp": 0}, "dp must be a positive integer (data-parallel replicas), got 0"),
    ({"dp": True}, "dp must be a positive integer (data-parallel replicas), got True"),
    ({"grad_reduction": "max"}, "grad_reduction='max' is not known; choose 'mean' or 'sum'"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a positive number, got 0"),
    ({"bucket_cap_mb": True}, "bucket_cap_mb must be a positive number, got True"),
    ({"timeout_s": "60"}, "timeout_s must be a positive number of seconds, got '60'"),
    ({"seed": 1.0}, "seed must be an integer (it seeds the shuffle order), got 1.0"),
    ({"checkpoint_every": 0}, "checkpoint_every must be a positive number of steps or None (every epoch), got 0"),
    ({"checkpoint_keep": 0}, "checkpoint_keep must be a positive integer (2 keeps a fallback), got 0"),
    ({"on_nonfinite": "warn"}, "on_nonfinite='warn' is not known; choose one of ['stop', 'skip', 'ignore']"),
    ({"memory_limit_bytes": -1}, "memory_limit_bytes must be a positive number of bytes or None, got -1"),
])
def test_errors_name_the_bad_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config(**kwargs)
    assert str(info.value) == message


# -- stages for a world size --------------------------------------------------------------------


def test_stages_for_a_world_size() -> None:
    assert Config().stages_for(4) == 4  # nothing given: one pipeline over every rank
    assert Config(dp=2).stages_for(6) == 3
    assert Config(layers_per_stage=[2, 3, 3]).stages_for(3) == 3
    assert Config(layers_per_stage=[2, 3, 3], dp=2).stages_for(6) == 3
    assert Config(num_stages=2, dp=2).stages_for(4) == 2
    interleaved = Config(layers_per_stage=[1, 1, 1, 1], schedule="interleaved", num_virtual_stages=2)
    assert interleaved.stages_for(2) == 2  # 4 chunks, 2 per rank
    assert Config(split_points=["h.1", "ln_f"]).stages_for(3) == 3  # a stage before each point, and one more
    assert Config(split_points=["h.1"], num_stages=2, dp=2).stages_for(4) == 2
    assert Config(split_points=["a", "b", "c"], schedule="interleaved", num_virtual_stages=2).stages_for(2) == 2


def test_stages_for_a_world_that_does_not_fit_prints_every_factor() -> None:
    with pytest.raises(ConfigError) as info:
        Config(layers_per_stage=[2, 3, 3], dp=2).stages_for(4)
    assert str(info.value) == (
        "the config asks for 3 pipeline stages x dp=2 replicas = 6 ranks (layers_per_stage=[2, 3, 3], "
        "num_stages=None, dp=2) but the world size is 4; launch 6 ranks (plait run -n 6 ...) or change the config")
    with pytest.raises(ConfigError) as info:
        Config(dp=2).stages_for(5)
    assert str(info.value) == ("world size 5 does not divide by dp=2; launch a multiple of 2 ranks, "
                               "or set dp to a factor of 5")
    with pytest.raises(ConfigError) as info:
        Config(split_points=["h.1"]).stages_for(4)
    assert str(info.value) == (
        "the config asks for 2 pipeline stages x dp=1 replicas = 2 ranks (split_points=['h.1'], "
        "num_stages=None, dp=1) but the world size is 4; launch 2 ranks (plait run -n 2 ...) or change the config")


# -- JSON ---------------------------------------------------------------------------------------


def test_to_dict_is_json_ready_and_round_trips() -> None:
    config = Config(layers_per_stage=[2, 3], num_microbatches=4, schedule="zbh1", recompute=[0],
                    dp=2, bucket_cap_mb=1.5, checkpoint_dir="ckpt", on_nonfinite="skip", replan=True)
    data = config.to_dict()
    assert data["layers_per_stage"] == [2, 3] and data["recompute"] == [0]
    assert json.loads(json.dumps(data)) == data
    assert sorted(data) == sorted(f.name for f in dataclasses.fields(Config))
    assert Config.from_dict(data) == config
    assert Config.from_json(config.to_json()) == config
    assert Config.from_json(Config().to_json()) == Config()
    by_name = Config(split_points=["h.1", "ln_f"], dp=2)
    assert by_name.to_dict()["split_points"] == ["h.1", "ln_f"]
    assert Config.from_json(by_name.to_json()) == by_name


def test_from_dict_fills_missing_fields_with_defaults() -> None:
    assert Config.from_dict({"dp": 2}) == Config(dp=2)
    assert Config.from_json(b'{"seed": 7}') == Config(seed=7)


def test_from_dict_names_unknown_fields() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"dp": 1, "stages": 2, "lr": 0.1})
    known = sorted(f.name for f in dataclasses.fields(Config))
    assert str(info.value) == f"unknown Config fields ['lr', 'stages']; known: {known}"


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "a Config is a JSON object of its fields, got list"),
    ('"dp"', "a Config is a JSON object of its fields, got str"),
    ("{dp: 1}", "not a plait Config: not JSON (JSONDecodeError: "),
    ('{"dp": 0}', "dp must be a positive integer (data-parallel replicas), got 0"),
])
def test_from_json_of_anything_else_is_a_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_json(text)
    assert str(info.value).startswith(message)


def test_leaf_modules_take_names_and_classes_and_keep_the_config_json() -> None:
    from torch import nn

    config = Config(leaf_modules=["model.layers.0.mlp", nn.LayerNorm])
    assert config.leaf_modules == ("model.layers.0.mlp", "LayerNorm")  # a class by its name
    assert Config.from_json(config.to_json()) == config


@pytest.mark.parametrize("value, message", [
    ("mlp", "leaf_modules must be a list of module names or classes, got 'mlp'"),
    (["mlp", ""], r"leaf_modules=\['mlp', ''\] holds \[''\]"),
    ([3], r"holds \[3\]: give module names"),
])
def test_leaf_modules_errors_name_the_value(value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Config(leaf_modules=value)


@pytest.mark.parametrize("kwargs, message", [
    ({"zero": 4}, "zero must be 0, 1, 2, 3 or None, got 4"),
    ({"zero": True}, "zero must be 0, 1, 2, 3 or None, got True"),
    ({"offload": "optimizer", "zero": 2}, r"offload='optimizer' runs with the parameters sharded .* but zero=2; "
                                          r"set Config\(zero=3, offload='optimizer'\)"),
    ({"offload": "params", "zero": 3}, r"offload='params' is not known; choose 'optimizer'"),
    ({"offload": 0, "zero": 3}, r"offload=0 is not known; choose 'optimizer'"),
    ({"offload": True, "zero": 3}, r"offload=True is not known; choose 'optimizer' .*, False \(never\) or None"),
    ({"zero": 3, "schedule": "zbh1", "replan": True}, r"zero=3 \(parameters sharded over the replicas\) does not run with "
                                                      r"\{'replan': True\}"),
    ({"zero": 3, "stage_dp": (2, 1), "layers_per_stage": (3, 4)},
     r"does not run with \{'stage_dp': \(2, 1\)\} yet; leave those at their defaults \(one width for every stage"),
    ({"zero": 1, "dp": 1}, r"zero=1 shards over a stage's replicas, but dp=1 has one replica; set dp > 1 or zero=0"),
    ({"zero": 2, "dp": 1}, r"zero=2 shards over a stage's replicas, but dp=1 has one replica"),
])
def test_zero_errors_name_the_value_and_the_fix(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


def test_zero_round_trips_and_defaults_to_open() -> None:
    assert Config().zero is None
    assert Config.from_json(Config(zero=1, dp=2).to_json()).zero == 1
    assert Config(zero=3).tp is None and Config.from_json(Config(zero=3, dp=2).to_json()).zero == 3  # tp: the planner's
    assert Config(zero=3, tp=2).tp == 2  # given: tp cuts, zero=3 shards each part
    assert Config(zero=3, precision="bf16").precision == "bf16"  # FSDP2 gathers the low copies


# -- tensor parallelism ---------------------------------------------------------------------------


def test_tp_lanes_and_errors() -> None:
    assert Config(tp=2).lanes(8) == 4
    assert Config(tp=2, num_stages=2, dp=2).stages_for(Config(tp=2).lanes(8)) == 2
    with pytest.raises(ConfigError, match=r"2 pipeline stages x dp=1 replicas x tp=2 = 4 ranks.*world size is 8"):
        Config(tp=2, num_stages=2).stages_for(4)
    with pytest.raises(ConfigError, match=r"world size 6 does not factor as pp x dp x tp with tp=4.*\[1, 2, 3, 6\]"):
        Config(tp=4).lanes(6)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="tp must be a positive integer"):
            Config(tp=bad)
    with pytest.raises(ConfigError, match="strategy is one of"):
        Config(tp=2, tp_plan={"*.fc": "diagonal"})
    with pytest.raises(ConfigError, match="tp=1"):
        Config(tp=1, tp_plan={"*.fc": "colwise"})
    assert Config().tp is None and Config().lanes(6) == 6  # the planner's choice, until it chooses
    assert Config().with_defaults().tp == 1 and Config(tp_plan={"*.fc": "colwise"}).with_defaults().tp_plan is None
    config = Config(tp=2, tp_plan={"*.fc": "colwise", "*.proj": "rowwise"})
    assert config.tp_plan == (("*.fc", "colwise"), ("*.proj", "rowwise"))
    assert Config.from_json(config.to_json()) == config


# -- stages of different tp widths ----------------------------------------------------------------

def test_stage_tp_gives_one_lane_per_stage_on_the_sum_of_the_widths() -> None:
    config = Config(layers_per_stage=[3, 4], stage_tp=[2, 1])
    assert config.stage_tp == (2, 1)
    assert config.lanes(3) == 2 and config.stages_for(config.lanes(3)) == 2
    with pytest.raises(ConfigError, match=r"stage_tp=\[2, 1\], 3 ranks in all, on world_size=4; .*: launch 3 ranks"):
        config.lanes(4)
    assert Config.from_json(config.to_json()) == config
    assert Config(split_points=["h.1"], stage_tp=(1, 2)).stage_tp == (1, 2)
    assert Config(layers_per_stage=(3, 4), stage_tp=(2, 1), checkpoint_dir="c").checkpoint_dir == "c"
    copies = Config(layers_per_stage=(3, 4), stage_tp=(2, 1), dp=2, zero=1)  # two copies of the pipeline
    assert copies.lanes(6) == 4 and copies.stages_for(copies.lanes(6)) == 2
    with pytest.raises(ConfigError, match=r"stage_tp=\[2, 1\] x dp=2, 6 ranks in all, on world_size=3; "
                                          r".*: launch 6 ranks"):
        copies.lanes(3)


@pytest.mark.parametrize("kwargs, message", [
    ({"stage_tp": (2, 1)}, r"gives 2 stages but the cut gives none; give layers_per_stage"),
    ({"stage_tp": (2, 1, 1), "layers_per_stage": (3, 4)}, "gives 3 stages but the cut gives 2"),
    ({"stage_tp": (2, 0), "layers_per_stage": (3, 4)}, r"one positive tp per stage, e.g. \(2, 1\), got \(2, 0\)"),
    ({"stage_tp": "21", "layers_per_stage": (3, 4)}, "one positive tp per stage"),
    ({"stage_tp": (2, 1), "layers_per_stage": (3, 4), "zero": 1}, r"does not run with \{'zero': 1\}.*zero needs dp > 1"),
    ({"stage_tp": (2, 1), "layers_per_stage": (3, 4), "tp": 2}, r"\{'tp': 2\}"),
    ({"stage_tp": (2, 1), "layers_per_stage": (3, 4), "replan": True}, "replan"),
    ({"stage_tp": (2, 1), "layers_per_stage": (3, 4), "zero": 1}, r"\{'zero': 1\}"),
    ({"stage_tp": (2, 1, 2, 1), "layers_per_stage": (1, 1, 1, 1), "schedule": "interleaved",
      "num_virtual_stages": 2}, "num_virtual_stages"),
    ({"stage_tp": (2, 1), "layers_per_stage": (3, 4), "sequence_parallel": True}, "sequence_parallel"),
])
def test_stage_tp_refuses_what_it_does_not_run(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="bfloat16"), "precision='bfloat16' is not known; choose one of"),
    (dict(reduce_precision="fp16"), "reduce_precision='fp16' is not known; choose 'fp32' \\(default\\) or 'bf16'"),
])
def test_precision_errors_name_the_value_and_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


def test_precision_defaults_to_fp32_and_round_trips() -> None:
    assert Config().precision == "fp32"
    assert Config.from_json(Config(precision="bf16").to_json()).precision == "bf16"


@pytest.mark.parametrize("value", [None, "", 1, ["inductor"]])
def test_compile_takes_a_flag_or_a_backend_name(value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"compile={re.escape(repr(value))} is not known; give True .* or a torch.compile backend"):
        Config(compile=value)
    assert Config(compile=True).execution().compile_backend == "inductor"
    assert Config(compile="aot_eager").execution().compile_backend == "aot_eager"
    assert Config().execution().compile_backend is None


def test_compile_refuses_what_it_does_not_run_with() -> None:
    with pytest.raises(ConfigError, match=r"compile=True with batch_weight_grads=True: .* set batch_weight_grads=False"):
        Config(compile=True, batch_weight_grads=True)
    with pytest.raises(ConfigError, match=r"compile='aot_eager' with zero=3: .* set zero to 0, 1 or 2"):
        Config(compile="aot_eager", zero=3)
    assert Config.from_json(Config(compile="aot_eager").to_json()).compile == "aot_eager"
