"""The layout's fields have the Plan's names; the old ones (layers_per_proc, tp_per_stage, dp_per_stage)
still work: made, read, replaced, loaded from JSON, and in plan files saved before, no processes."""

import dataclasses
import json

import pytest

from plait.config import Config
from plait.errors import ConfigError
from plait.planner.replay import load_plan_file
from plait.planner.plan_report import PlanReport

# old name -> new name, and a value each takes with layers (3, 4)
ALIASES = [("layers_per_proc", "layers_per_stage", (3, 4)), ("tp_per_stage", "stage_tp", (2, 1)),
           ("dp_per_stage", "stage_dp", (2, 1))]


def _made(name: str, value: tuple[int, ...]) -> Config:
    """A Config given `name`=`value`, with the cut the widths need."""
    return Config(**{name: value}) if "layers" in name else Config(layers_per_stage=(3, 4), **{name: value})


@pytest.mark.parametrize("old, new, value", ALIASES)
def test_the_old_name_sets_and_reads_the_new_field(old: str, new: str, value: tuple[int, ...]) -> None:
    config = _made(old, list(value))
    assert getattr(config, new) == value and getattr(config, old) == value  # checked and kept as a tuple
    assert config == _made(new, value)
    assert old not in {f.name for f in dataclasses.fields(Config)}  # one field, the new name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, old, value)


@pytest.mark.parametrize("old, new, value", ALIASES)
def test_both_names_agree_or_are_refused_by_name(old: str, new: str, value: tuple[int, ...]) -> None:
    assert getattr(_made(old, value), new) == value
    if "layers" in old:
        assert Config(layers_per_proc=value, layers_per_stage=list(value)).layers_per_stage == value  # equal
        with pytest.raises(ConfigError) as info:
            Config(layers_per_proc=(4, 3), layers_per_stage=value)
    else:
        both = {old: value, new: value}
        assert getattr(Config(layers_per_stage=(3, 4), **both), new) == value
        with pytest.raises(ConfigError) as info:
            Config(layers_per_stage=(3, 4), **{old: (1, 2), new: value})
    wrong = "[4, 3]" if "layers" in old else "[1, 2]"
    assert str(info.value) == (f"Config: {old}={wrong} and {new}={list(value)} name one field ({old} is {new}'s "
                               f"old name) with different values; give {new} alone")


@pytest.mark.parametrize("old, new, value", ALIASES)
def test_replace_takes_the_old_name(old: str, new: str, value: tuple[int, ...]) -> None:
    """replace() passes every field by its new name beside the old one: None there is "not given"."""
    base = Config() if "layers" in old else Config(layers_per_stage=(3, 4))
    assert getattr(dataclasses.replace(base, **{old: value}), new) == value
    made = _made(new, value)
    assert dataclasses.replace(made, **{old: value}) == made  # the same value again: no conflict


def test_replace_of_a_set_field_by_its_old_name_names_the_fix() -> None:
    """The one case replace() cannot take: a different value under the old name of a field already set."""
    with pytest.raises(ConfigError, match=r"layers_per_proc=\[2, 5\] and layers_per_stage=\[3, 4\] name one field"
                                          r".*; give layers_per_stage alone"):
        dataclasses.replace(Config(layers_per_stage=(3, 4)), layers_per_proc=(2, 5))
    assert dataclasses.replace(Config(layers_per_stage=(3, 4)), layers_per_stage=(2, 5)).layers_per_proc == (2, 5)


def test_from_dict_and_from_json_take_the_old_keys_and_write_the_new_ones() -> None:
    old = {"layers_per_proc": [3, 4], "tp_per_stage": [2, 1], "dp": 2}
    config = Config.from_dict(old)
    assert (config.layers_per_stage, config.stage_tp, config.dp) == ((3, 4), (2, 1), 2)
    assert Config.from_json(json.dumps(old)) == config
    assert Config.from_json(json.dumps({"layers_per_proc": [3, 4], "dp_per_stage": [1, 2]})).stage_dp == (1, 2)
    data = config.to_dict()
    assert data["layers_per_stage"] == [3, 4] and data["stage_tp"] == [2, 1]
    assert not {"layers_per_proc", "tp_per_stage", "dp_per_stage"} & data.keys()
    with pytest.raises(ConfigError, match=r"layers_per_proc=\[1, 6\] and layers_per_stage=\[3, 4\]"):
        Config.from_dict({"layers_per_proc": [1, 6], "layers_per_stage": [3, 4]})
    with pytest.raises(ConfigError, match=r"unknown Config fields \['stage_pp'\]"):
        Config.from_dict({"stage_pp": [1]})


def _old_report(widths: dict) -> dict:
    """A plan report as `model.plan_report.save()` wrote it before: stage widths under tp_per_stage /
    dp_per_stage."""
    return {"pp": 2, "dp": 1, "tp": 1, **widths, "num_microbatches": 2, "schedule": "gpipe",
            "num_virtual_stages": 1, "recompute": False, "zero": 0, "batch_weight_grads": False,
            "layers_per_stage": [5, 6], "feasible": True, "global_batch": 8, "source": "planned",
            "stages": [{"stage": s, "tp": 1, "num_layers": n, "first_layer": 5 * s, "time_s": 0.1}
                       for s, n in enumerate((5, 6))]}


def test_a_plan_file_saved_with_the_old_keys_still_loads(tmp_path) -> None:
    names = tuple(str(i) for i in range(11))
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_old_report({"tp_per_stage": [2, 1], "crossing": "whole"})))
    fields, report = load_plan_file(str(path), names, 3)
    assert (fields["stage_tp"], fields["crossing"], fields["layers_per_stage"]) == ([2, 1], "whole", [5, 6])
    assert report is not None and "stage_tp=[2, 1]" in report.table
    config = dataclasses.replace(Config(), **{**fields, "layers_per_stage": tuple(fields["layers_per_stage"])})
    assert config.stage_tp == (2, 1) and config.lanes(3) == 2
    path.write_text(json.dumps(_old_report({"dp_per_stage": [1, 3]})))
    assert load_plan_file(str(path), names, 4)[0]["stage_dp"] == [1, 3]
    path.write_text(json.dumps(_old_report({"tp_per_stage": [2, 1], "stage_tp": [1, 2]})))
    with pytest.raises(ConfigError, match=r"Config\(plan=.*\): tp_per_stage=\[2, 1\] and stage_tp=\[1, 2\]"):
        load_plan_file(str(path), names, 3)


def test_a_plan_report_saved_with_the_old_keys_reads_back_with_the_new_ones() -> None:
    report = PlanReport.from_dict(_old_report({"dp_per_stage": [1, 3]}), "table")
    assert report.chosen["stage_dp"] == [1, 3] and "dp_per_stage" not in report.chosen
    assert PlanReport.from_dict(report.to_dict(), "table").chosen == report.chosen
