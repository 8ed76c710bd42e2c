"""Tests for plait.plan.layer_costs: per-layer costs checked when made, times affine in rows, and the
JSON round trip."""

from __future__ import annotations

import json
import math

import pytest

from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts
from tests.plan.factory import layer_costs


def costs3(**changes: object) -> LayerCosts:
    """Three layers with distinct, exact numbers."""
    fields = dict(
        names=("emb", "block", "head"),
        forward_fixed_s=(1.0, 0.0, 2.0), forward_row_s=(0.5, 1.0, 0.25),
        backward_fixed_s=(0.0, 1.0, 0.0), backward_row_s=(1.0, 2.0, 0.5),
        weight_fixed_s=(0.0, 0.0, 1.0), weight_row_s=(0.0, 1.0, 0.25),
        activation_row_bytes=(8, 16, 4), output_row_bytes=(8, 8, 4),
        param_bytes=(100, 200, 300), grad_bytes=(100, 200, 0), optimizer_s=(0.1, 0.2, 0.0),
        input_row_bytes=4.0, uncuttable=[[0, 1]], source="by hand",
    )
    fields.update(changes)
    return LayerCosts(**fields)  # type: ignore[arg-type]


def test_layer_costs_check_themselves_and_round_trip() -> None:
    costs = layer_costs(3, activation=5.0)
    assert LayerCosts.from_json(costs.to_json()) == costs
    with pytest.raises(ConfigError, match="has 2 entries for 3 layers"):
        LayerCosts.from_dict({**costs.to_dict(), "param_bytes": [1.0, 2.0]})
    with pytest.raises(ConfigError, match="finite and >= 0"):
        LayerCosts.from_dict({**costs.to_dict(), "optimizer_s": [1.0, -2.0, 0.0]})
    with pytest.raises(ConfigError, match="uncuttable region"):
        LayerCosts.from_dict({**costs.to_dict(), "uncuttable": [[1, 5]]})
    assert costs.forward(4) == [4.0] * 3 and costs.backward(2) == [4.0] * 3


def test_times_are_fixed_plus_per_row() -> None:
    costs = costs3()
    assert costs.num_layers == 3
    assert costs.forward(4) == [3.0, 4.0, 3.0]
    assert costs.backward(4) == [4.0, 9.0, 2.0]
    assert costs.weight(4) == [0.0, 4.0, 2.0]
    assert costs.forward(0) == [1.0, 0.0, 2.0]  # the fixed part alone


def test_fields_are_normalised_to_tuples_of_floats() -> None:
    costs = costs3(names=["emb", "block", 3])
    assert costs.names == ("emb", "block", "3")
    assert costs.activation_row_bytes == (8.0, 16.0, 4.0) and type(costs.param_bytes[0]) is float
    assert costs.uncuttable == ((0, 1),)


def test_round_trip_keeps_every_field() -> None:
    costs = costs3()
    data = costs.to_dict()
    assert data["names"] == ["emb", "block", "head"] and data["uncuttable"] == [[0, 1]]
    assert data["source"] == "by hand" and data["input_row_bytes"] == 4.0
    assert json.loads(costs.to_json()) == json.loads(json.dumps(data))
    assert LayerCosts.from_json(costs.to_json()) == costs
    assert LayerCosts.from_dict(data) == costs


@pytest.mark.parametrize("changes, message", [
    ({"names": ()}, "LayerCosts needs at least one layer"),
    ({"forward_row_s": (1.0, 2.0)},
     "LayerCosts.forward_row_s has 2 entries for 3 layers (emb, block, head); give one per layer"),
    ({"grad_bytes": (1.0, math.inf, 0.0)}, "LayerCosts.grad_bytes must be finite and >= 0, got [(1, inf)]"),
    ({"optimizer_s": (-1.0, math.nan, 0.0)},
     "LayerCosts.optimizer_s must be finite and >= 0, got [(0, -1.0), (1, nan)]"),
    ({"uncuttable": [[2, 1]]}, "uncuttable region (2, 1) is not a range of layers 0..2 (a < b)"),
    ({"uncuttable": [[1, 3]]}, "uncuttable region (1, 3) is not a range of layers 0..2 (a < b)"),
])
def test_bad_costs_say_which_field_and_value(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        costs3(**changes)
    assert str(info.value) == message


def test_many_layers_are_abbreviated_in_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        LayerCosts.from_dict({**layer_costs(6).to_dict(), "param_bytes": [1.0]})
    assert str(info.value) == ("LayerCosts.param_bytes has 1 entries for 6 layers (l0, l1, l2, l3, ...); "
                               "give one per layer")


def test_unknown_keys_are_not_layer_costs() -> None:
    with pytest.raises(ConfigError) as info:
        LayerCosts.from_dict({**layer_costs(1).to_dict(), "flops": [1.0], "mystery": 2})
    assert str(info.value) == "not LayerCosts data: unknown keys ['flops', 'mystery']"
