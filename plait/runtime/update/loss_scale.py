"""`LossScale`: fp16's dynamic loss scaling over every rank, with `torch.amp.GradScaler`'s semantics.

An fp16 stage (`Plan.precision` "fp16") computes with fp16 copies of its parameters, whose small
gradients would flush to zero: each micro-batch's loss is multiplied by the scale S before its
backward, so the gradients added into the fp32 masters are S times too large. Before the optimizer
step, as `scaler.unscale_(optimizer)` and `scaler.step(optimizer)` then `scaler.update()`:

    found   whether any gradient this rank holds is not finite, agreed over every rank (one
            all-reduce: a stage that overflowed makes every rank skip the same step)
    found   no optimizer step on any rank; S *= backoff (0.5); the growth count restarts
    else    every gradient *= 1/S, then the step (clipping sees unscaled gradients); after
            `growth_interval` (2000) steps in a row without one, S *= growth (2)

S starts at `initial` (2**16, GradScaler's). The state (S and the count) goes into checkpoints and
comes back on resume, so a resumed run scales as one never stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from plait.runtime.comm.collectives import max_floats

__all__ = ["LossScale"]


@dataclass
class LossScale:
    """GradScaler's state and rules (its defaults), shared by every rank of a job."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    skipped_steps: int = 0  # steps skipped for a non-finite gradient, this run

    def found_nonfinite(self, grads: Iterable[torch.Tensor | None], world_size: int) -> bool:
        """Whether any rank holds a non-finite gradient (a collective: every rank calls it)."""
        local = any(g is not None and not bool(torch.isfinite(_local(g)).all()) for g in grads)
        return (max_floats([float(local)])[0] if world_size > 1 else float(local)) > 0

    def unscale(self, grads: Iterable[torch.Tensor | None]) -> None:
        """Every gradient divided by the scale (as GradScaler, by multiplying with its inverse)."""
        inverse = 1.0 / self.scale
        for g in grads:
            if g is not None:
                _local(g).mul_(inverse)

    def update(self, found: bool) -> None:
        """The scale after a step: backed off where a gradient overflowed, grown after a run of good steps."""
        if found:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"a loss scale of {scale!r} in the checkpoint; it must be a positive number")
        self.scale, self.growth_tracker = scale, int(state["growth_tracker"])


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's values of `grad` (zero=3: a sharded gradient's own shard)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad
