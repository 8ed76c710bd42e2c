"""Tensor parallelism in the cost model: a layer's costs on one of tp ranks, and the search over tp.

What tp splits in each layer is data (`TpShares`, found on the captured graph by
`plait.planner.tp_shares` with the runtime's own layout): the parameter bytes it splits, the share
of the layer's work done on split values, and the bytes each collective it inserts moves per row.
On one of `tp` ranks a layer then costs (a the split share, 1 - a + a / tp its part):

    compute      forward, B and W          x (1 - a + a/tp)        fixed and per-row parts alike (a
                 small batch's matmul is bound by reading its weights, which split too); W's
                 fixed part as the parameters split (mostly the add of each micro-batch's
                 gradient into the accumulated one)
    forward      + all-reduce of each row-parallel output / vocab lookup   2(tp-1)/tp V/B + 2(tp-1) alpha
                 + all-gather of each split value leaving the layers       (tp-1)/tp V/B + (tp-1) alpha
    backward     + all-reduce of each column-parallel input's gradient     (Megatron's f and g)
    memory       parameters, gradients and optimizer step: the split bytes / tp; activations x (1 - a + a/tp)

(the ring formulas of `plait.cost.network`, on the link of tp consecutive ranks: one node).
`plait.search.tp_degree` prices every tp on world / tp ranks with these costs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from plait.cost.network import Link
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts

__all__ = ["TpShares", "at_tp"]

_PER_LAYER = ("split_bytes", "split_share", "forward_reduce_row_bytes", "backward_reduce_row_bytes",
              "gather_row_bytes", "forward_collectives", "backward_collectives")


@dataclass(frozen=True)
class TpShares:
    """What running each layer over `tp` ranks splits, and the collectives it adds.

    split_bytes: parameter bytes split over the ranks. split_share: the share (0..1) of the
    layer's work on split values (its ops' output elements); activation_share: of its saved
    activations (default: the same). *_row_bytes: bytes per row of a
    micro-batch all-reduced in the forward (row-parallel outputs, vocabulary lookups) and in the
    backward (column-parallel inputs' gradients), and gathered whole (split values leaving).
    *_collectives: how many collectives of each pass (each pays the link's latency).
    """

    tp: int
    split_bytes: tuple[float, ...]
    split_share: tuple[float, ...]
    forward_reduce_row_bytes: tuple[float, ...]
    backward_reduce_row_bytes: tuple[float, ...]
    gather_row_bytes: tuple[float, ...]
    forward_collectives: tuple[float, ...]
    backward_collectives: tuple[float, ...]
    layouts: tuple[str, ...] = ()  # what the layout splits and keeps whole, for the report
    activation_share: tuple[float, ...] = ()  # the share of saved activations split (): split_share

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"TpShares.tp must be a positive integer, got {self.tp!r}")
        n = len(self.split_bytes)
        for name in _PER_LAYER:
            values = tuple(float(x) for x in getattr(self, name))
            if len(values) != n or not all(math.isfinite(x) and x >= 0 for x in values):
                raise ConfigError(f"TpShares.{name} needs {n} finite values >= 0, got {values[:4]}")
            object.__setattr__(self, name, values)
        if not self.activation_share:
            object.__setattr__(self, "activation_share", self.split_share)
        shares = tuple(float(x) for x in self.activation_share)
        if len(shares) != n or any(not 0 <= x <= 1 for x in self.split_share + shares):
            raise ConfigError(f"TpShares.split_share and activation_share are shares (0..1), one per layer; got "
                              f"{self.split_share[:4]}, {shares[:4]}")
        object.__setattr__(self, "activation_share", shares)

    @property
    def splits(self) -> bool:
        """Whether any layer splits at all."""
        return any(self.split_share) or any(self.split_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TpShares":
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"not TpShares data: unknown keys {unknown}")
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)


def at_tp(costs: LayerCosts, shares: TpShares, link: Link) -> LayerCosts:
    """Each layer's costs on one of `shares.tp` ranks (see the module's table)."""
    if len(shares.split_bytes) != costs.num_layers:
        raise ConfigError(f"TpShares has {len(shares.split_bytes)} layers, the costs {costs.num_layers}; "
                          "find both on the same captured model")
    tp = shares.tp
    if tp == 1:
        return costs
    part = [1 - a + a / tp for a in shares.split_share]
    reduce_row, gather_row = 2 * (tp - 1) / (tp * link.bandwidth), (tp - 1) / (tp * link.bandwidth)
    reduce_fixed = link.collective_s(2 * (tp - 1))  # the ring all-reduce's latency (`all_reduce`)
    kept = [1 - min(s, p) / p * (1 - 1 / tp) if p > 0 else 1.0 for s, p in zip(shares.split_bytes, costs.param_bytes)]

    def scaled(values: tuple[float, ...], by: list[float]) -> tuple[float, ...]:
        return tuple(v * k for v, k in zip(values, by))

    return replace(
        costs,
        forward_fixed_s=tuple(f * k + c * reduce_fixed for f, k, c in zip(
            costs.forward_fixed_s, part, shares.forward_collectives)),
        forward_row_s=tuple(r * k + a * reduce_row + g * gather_row for r, k, a, g in zip(
            costs.forward_row_s, part, shares.forward_reduce_row_bytes, shares.gather_row_bytes)),
        backward_fixed_s=tuple(f * k + c * reduce_fixed for f, k, c in zip(
            costs.backward_fixed_s, part, shares.backward_collectives)),
        weight_fixed_s=scaled(costs.weight_fixed_s, kept),  # mostly the gradient's accumulation
        backward_row_s=tuple(r * k + a * reduce_row for r, k, a in zip(
            costs.backward_row_s, part, shares.backward_reduce_row_bytes)),
        weight_row_s=scaled(costs.weight_row_s, part),
        activation_row_bytes=scaled(costs.activation_row_bytes, [1 - a + a / tp for a in shares.activation_share]),
        param_bytes=scaled(costs.param_bytes, kept),
        copy_bytes=scaled(costs.copy_bytes, kept),
        grad_bytes=scaled(costs.grad_bytes, kept),
        optimizer_s=scaled(costs.optimizer_s, kept),
        source=f"{costs.source}; tp={tp}" if costs.source else f"tp={tp}",
    )
