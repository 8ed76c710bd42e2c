"""Metrics computed on the last stage from the model's output: counts that add up over batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from plait.errors import ConfigError

__all__ = ["METRICS", "logits_of", "check_metrics", "logs_of"]


def logits_of(output: Any) -> torch.Tensor:
    """The prediction tensor inside a model output: itself, `.logits`, ["logits"] or the first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "logits" in output:
            return logits_of(output["logits"])
        return logits_of(next(iter(output.values())))
    if hasattr(output, "logits"):
        return logits_of(output.logits)
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return logits_of(getattr(output, dataclasses.fields(output)[0].name))
    if isinstance(output, (tuple, list)) and output:
        return logits_of(output[0])
    raise ConfigError(f"cannot find a prediction tensor in a model output of type {type(output).__name__}")


def _accuracy(output: Any, target: torch.Tensor) -> tuple[float, float]:
    """(correct, counted) for class logits against class indices (or one-hot targets)."""
    predicted = logits_of(output).argmax(dim=-1)
    if target.dtype.is_floating_point and target.shape == logits_of(output).shape:
        target = target.argmax(dim=-1)
    return float((predicted == target).sum()), float(target.numel())


METRICS: dict[str, Callable[[Any, torch.Tensor], tuple[float, float]]] = {"accuracy": _accuracy}


def check_metrics(names: Sequence[str] | None) -> list[str]:
    """Validate metric names."""
    names = list(names or [])
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise ConfigError(f"unknown metrics {unknown}; plait knows {sorted(METRICS)}")
    return names


def logs_of(names: Sequence[str], sums: Sequence[float], rows: float) -> dict[str, float]:
    """The logs of summed step statistics: the mean loss over `rows`, then each metric's ratio.

    `sums` is [sum of loss x rows, then (correct, counted) per metric in `names`' order].
    """
    logs = {"loss": sums[0] / rows}
    for i, name in enumerate(names):
        logs[name] = sums[1 + 2 * i] / max(sums[2 + 2 * i], 1.0)
    return logs
