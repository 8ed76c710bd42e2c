"""LayerCosts: scaling every time by a measured factor, leaving bytes and layers alone."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from tests.plan.factory import layer_costs


def test_scaled_multiplies_every_time_and_nothing_else() -> None:
    costs = layer_costs(3, forward=1.0, backward=2.0, weight=0.5)
    scaled = costs.scaled(1.25, "busy cores")
    for name in ("forward_fixed_s", "forward_row_s", "backward_fixed_s", "backward_row_s",
                 "weight_fixed_s", "weight_row_s", "optimizer_s"):
        assert getattr(scaled, name) == pytest.approx(tuple(1.25 * x for x in getattr(costs, name))), name
    for name in ("names", "activation_row_bytes", "output_row_bytes", "param_bytes", "grad_bytes",
                 "input_row_bytes", "uncuttable"):
        assert getattr(scaled, name) == getattr(costs, name), name
    assert scaled.source.endswith("times x 1.25 (busy cores)")


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_scaled_refuses_factors_that_are_not_positive_numbers(factor: float) -> None:
    with pytest.raises(ConfigError, match="a time scale must be a finite number > 0"):
        layer_costs(2).scaled(factor, "x")
