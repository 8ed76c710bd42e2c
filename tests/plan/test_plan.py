"""The plan is data: JSON round trip, printable summary, validation."""

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
