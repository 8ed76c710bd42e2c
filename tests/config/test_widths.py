"""Config's checks of stages of different widths: the fields each needs and refuses, and the ranks
they take, no processes."""

import pytest

import plait
from plait.errors import ConfigError
from plait.plan.mesh import Mesh


@pytest.mark.parametrize("name", ["stage_tp", "stage_dp"])
def test_widths_are_kept_as_a_tuple_and_take_one_lane_per_stage(name: str) -> None:
    config = plait.Config(layers_per_stage=(2, 2, 1), **{name: [2, 1, 3]})
    assert getattr(config, name) == (2, 1, 3) and config.to_dict()[name] == [2, 1, 3]
    assert config.lanes(6) == 3  # the Mesh of the widths: one lane a stage
    with pytest.raises(ConfigError, match=rf"{name}=\[2, 1, 3\], 6 ranks in all, on world_size=5; "
                                          r".*: launch 6 ranks"):
        config.lanes(5)


def test_no_widths_leave_the_lanes_to_tp() -> None:
    assert Mesh.widths_lanes(4, None, None, 1) is None
    assert plait.Config(layers_per_stage=(2, 2), tp=2).lanes(4) == 2


def test_stage_dp_sets_tp_to_one_and_refuses_the_fields_it_does_not_run_with() -> None:
    assert plait.Config(layers_per_stage=(2, 2), stage_dp=(1, 2)).tp == 1
    with pytest.raises(ConfigError, match=r"stage_dp=\[1, 2\] .* does not run with \{'tp': 2, 'num_virtual_stages': "
                                          r"2\}; leave those fields at their defaults"):
        plait.Config(layers_per_stage=(2, 2, 2, 2), stage_dp=(1, 2), tp=2, num_virtual_stages=2, dp=None)
    # ZeRO shards a stage's state over its replicas: with a stage of two, not with none
    assert plait.Config(layers_per_stage=(2, 2), stage_dp=(1, 2), zero=2).zero == 2
    with pytest.raises(ConfigError, match=r"stage_dp=\[1, 1\] .* does not run with \{'zero': 1\}"):
        plait.Config(layers_per_stage=(2, 2), stage_dp=(1, 1), zero=1)
    with pytest.raises(ConfigError, match=r"stage_tp=\[2, 1\] .* does not run with \{'replan': True\}"):
        plait.Config(layers_per_stage=(2, 2), stage_tp=(2, 1), dp=2, replan=True)


@pytest.mark.parametrize("bad", [(), (2, 0), "21", (2, True), 2])
def test_bad_widths_are_named(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"stage_dp must list one positive dp \(data-parallel replicas\) "
                                          r"per stage, e.g. \(2, 1\)"):
        plait.Config(layers_per_stage=(2, 2), stage_dp=bad)


def test_crossing_takes_tiles_or_whole_and_is_named_when_bad_or_misplaced() -> None:
    assert plait.Config(layers_per_stage=(2, 2), stage_tp=(2, 1), crossing="whole").crossing == "whole"
    with pytest.raises(ConfigError, match=r"crossing='gather'; use 'tiles' .*, 'whole' .* or None"):
        plait.Config(layers_per_stage=(2, 2), stage_tp=(2, 1), crossing="gather")
    with pytest.raises(ConfigError, match=r"crossing='whole' is for stages of different tp widths \(stage_tp\)"):
        plait.Config(layers_per_stage=(2, 2), stage_dp=(2, 1), crossing="whole")
