"""`LayerCosts`: one model's per-layer times, bytes and memory as plain arrays, JSON-ready.

Measured by `plait.planner.profile` or derived from a description by `plait.cost.analytic`; the cost
model, the partition and the search read nothing else, so they are tested on random arrays.
Times are affine in the micro-batch's rows -- t(rows) = fixed + per_row * rows -- because a
small micro-batch does not run proportionally faster (kernel launches, per-op overheads):
without the fixed part every planner would pick as many micro-batches as there are rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from plait.errors import ConfigError

__all__ = ["LayerCosts"]

_PER_LAYER = (
    "forward_fixed_s", "forward_row_s", "backward_fixed_s", "backward_row_s",
    "weight_fixed_s", "weight_row_s", "activation_row_bytes", "output_row_bytes",
    "param_bytes", "grad_bytes", "optimizer_s",
)


@dataclass(frozen=True)
class LayerCosts:
    """Costs of each captured layer (index i = layer i), for one optimizer step's pieces.

    forward_*: the layer's forward; backward_*: the gradient of its inputs (B); weight_*: the
    gradient of its weights (W) -- B + W is the whole backward, which schedules that do not
    split it run as one. activation_row_bytes: saved for the backward, per row of a micro-batch.
    output_row_bytes[i]: sent across a cut after layer i, per row (everything later layers
    need from layers 0..i; the last entry is what the model returns). input_row_bytes: the
    model's inputs per row. param_bytes: parameters and buffers; grad_bytes: gradients of the
    trainable ones (optimizer state is a multiple of these, chosen with the optimizer).
    optimizer_s: the optimizer's step over the layer's parameters.
    """

    names: tuple[str, ...]
    forward_fixed_s: tuple[float, ...]
    forward_row_s: tuple[float, ...]
    backward_fixed_s: tuple[float, ...]
    backward_row_s: tuple[float, ...]
    weight_fixed_s: tuple[float, ...]
    weight_row_s: tuple[float, ...]
    activation_row_bytes: tuple[float, ...]
    output_row_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    grad_bytes: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    input_row_bytes: float = 0.0
    uncuttable: tuple[tuple[int, int], ...] = ()
    source: str = ""  # how the numbers were obtained, for the report
    # the low-precision copies' bytes within param_bytes (`plait.cost.memory.held_in_precision`;
    # empty: none): zero=3 shards the masters and gathers the copies a layer at a time
    copy_bytes: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0:
            raise ConfigError("LayerCosts needs at least one layer")
        for name in _PER_LAYER:
            values = tuple(float(x) for x in getattr(self, name))
            if len(values) != n:
                raise ConfigError(
                    f"LayerCosts.{name} has {len(values)} entries for {n} layers "
                    f"({', '.join(self.names[:4])}{', ...' if n > 4 else ''}); give one per layer"
                )
            bad = [(i, x) for i, x in enumerate(values) if not (math.isfinite(x) and x >= 0)]
            if bad:
                raise ConfigError(f"LayerCosts.{name} must be finite and >= 0, got {bad[:3]}")
            object.__setattr__(self, name, values)
        object.__setattr__(self, "names", tuple(str(x) for x in self.names))
        object.__setattr__(self, "copy_bytes", tuple(float(x) for x in self.copy_bytes))
        if self.copy_bytes and len(self.copy_bytes) != n:
            raise ConfigError(f"LayerCosts.copy_bytes has {len(self.copy_bytes)} entries for {n} layers; "
                              "give one per layer, or none")
        object.__setattr__(self, "uncuttable", tuple((int(a), int(b)) for a, b in self.uncuttable))
        for a, b in self.uncuttable:
            if not 0 <= a < b < n:
                raise ConfigError(
                    f"uncuttable region {(a, b)} is not a range of layers 0..{n - 1} (a < b)"
                )

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def forward(self, rows: float) -> list[float]:
        """Each layer's forward time for a micro-batch of `rows` rows."""
        return [a + b * rows for a, b in zip(self.forward_fixed_s, self.forward_row_s)]

    def backward(self, rows: float) -> list[float]:
        """Each layer's input-gradient (B) time for `rows` rows."""
        return [a + b * rows for a, b in zip(self.backward_fixed_s, self.backward_row_s)]

    def weight(self, rows: float) -> list[float]:
        """Each layer's weight-gradient (W) time for `rows` rows."""
        return [a + b * rows for a, b in zip(self.weight_fixed_s, self.weight_row_s)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["names"] = list(self.names)
        data["uncuttable"] = [list(r) for r in self.uncuttable]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayerCosts":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"not LayerCosts data: unknown keys {unknown}")
        values: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        values["uncuttable"] = tuple(tuple(r) for r in data.get("uncuttable", ()))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "LayerCosts":
        return cls.from_dict(json.loads(text))
