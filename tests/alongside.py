"""Training with plait and, alongside, the same model in one process: what differs, as text.

Every rank runs both; a test collects each rank's problems and asserts there are none, so a
failure names the step, the tensor and how far apart they were.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

import plait


def _call(net: nn.Module, x: Any) -> Any:
    return net(**x) if isinstance(x, dict) else net(x)


def train_alongside(model: plait.Model, ref: nn.Module, ref_opt: torch.optim.Optimizer,
                    loss_fn: Callable[[Any, Any], torch.Tensor], batches: Iterable[tuple[Any, Any]]) -> list[str]:
    """One `train_on_batch` and one reference step per batch; each step's loss compared (fp32: rtol
    1e-5, atol 1e-6)."""
    problems = []
    for step, (x, y) in enumerate(batches):
        got = model.train_on_batch(x, y)
        ref_opt.zero_grad()
        loss = loss_fn(_call(ref, x), y)
        loss.backward()
        ref_opt.step()
        if abs(got - float(loss)) > 1e-5 * abs(float(loss)) + 1e-6:
            problems.append(f"loss of step {step}: {got} != {float(loss)}")
    return problems


def state_problems(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Every tensor of `want` against `state` (missing ones included)."""
    problems = []
    for key, value in want.items():
        try:
            torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol)
        except (AssertionError, KeyError) as e:
            problems.append(f"{key}: {str(e).splitlines()[0]}")
    return problems
