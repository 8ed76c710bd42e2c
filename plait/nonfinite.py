"""`NonFiniteWatch`: in which stage a training step first made a NaN or infinite value.

A forward hook on each of this rank's stage modules flags a stage whose output holds a NaN or
an infinity; the last stage also flags a non-finite loss. The flags (one per stage, then the
loss) ride in the step's all-reduce of the loss, so every rank learns the same first stage and
stops, or skips the optimizer step, together.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree

from plait.pipeline import Pipeline

__all__ = ["NonFiniteWatch", "first_nonfinite"]


class NonFiniteWatch:
    """Flags kept during one training step for the stages of one rank."""

    def __init__(self, pipe: Pipeline):
        self.num_stages = pipe.plan.num_stages
        self.flags = [0.0] * (self.num_stages + 1)
        self.active = False
        self._handles = [ex.stage.module.register_forward_hook(partial(self._check, s))
                         for s, ex in pipe.executors.items()]

    def _check(self, stage_index: int, module: Any, args: Any, output: Any) -> None:
        if not self.active or self.flags[stage_index]:
            return
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                if not bool(torch.isfinite(t.detach()).all()):
                    self.flags[stage_index] = 1.0
                    return

    def start(self) -> None:
        self.flags = [0.0] * (self.num_stages + 1)
        self.active = True

    def finish(self, losses: dict[int, float]) -> list[float]:
        """This rank's flags for the step: stage outputs, then the loss (`losses` of the last stage)."""
        self.active = False
        if any(not math.isfinite(v) for v in losses.values()):
            self.flags[-1] = 1.0
        return list(self.flags)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def first_nonfinite(flags: list[float]) -> int | None:
    """The first stage whose output was flagged, num_stages for the loss alone, or None."""
    return next((i for i, f in enumerate(flags) if f), None)
