"""LayerCosts for tests: uniform layers, or random ones from a seed."""

from __future__ import annotations

import random

from plait.plan.layer_costs import LayerCosts


def layer_costs(n: int, forward: float = 1.0, backward: float = 2.0, weight: float = 0.0,
                activation: float = 0.0, output: float = 0.0, params: float = 0.0,
                optimizer: float = 0.0, fixed: float = 0.0, weight_fixed: float = 0.0) -> LayerCosts:
    """n identical layers; times per row (plus `fixed` per F and B pass, `weight_fixed` per W),
    bytes per row or per layer."""
    return LayerCosts(
        names=tuple(f"l{i}" for i in range(n)),
        forward_fixed_s=(fixed,) * n, forward_row_s=(forward,) * n,
        backward_fixed_s=(fixed,) * n, backward_row_s=(backward,) * n,
        weight_fixed_s=(weight_fixed,) * n, weight_row_s=(weight,) * n,
        activation_row_bytes=(activation,) * n, output_row_bytes=(output,) * n,
        param_bytes=(params,) * n, grad_bytes=(params,) * n, optimizer_s=(optimizer,) * n,
    )


def random_costs(rng: random.Random, n: int) -> LayerCosts:
    """n layers of random integer-valued costs (so sums are exact)."""

    def ints(low: int, high: int) -> tuple[float, ...]:
        return tuple(float(rng.randint(low, high)) for _ in range(n))

    return LayerCosts(
        names=tuple(f"l{i}" for i in range(n)),
        forward_fixed_s=ints(0, 2), forward_row_s=ints(1, 4),
        backward_fixed_s=ints(0, 2), backward_row_s=ints(1, 8),
        weight_fixed_s=(0.0,) * n, weight_row_s=ints(0, 3),
        activation_row_bytes=ints(0, 50), output_row_bytes=ints(0, 20),
        param_bytes=ints(0, 100), grad_bytes=ints(0, 100), optimizer_s=ints(0, 2),
    )
