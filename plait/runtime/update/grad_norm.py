"""The global gradient norm of a step, each element counted once over every rank, and clipping to it.

`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` in one process sees every gradient
once. On the ranks, once the sums are done (replicas all-reduced, tied parameters summed), a
gradient can be on several ranks: each replica of a stage holds the same one, a tied parameter's
holders hold the same sum, and the ranks of a tp group hold either a part of a split parameter or
the same whole one. Each rank adds the squares of the gradients it *counts*:

    a parameter split over a tp group   its part, on each rank of the first holder's owning replica
    a parameter sharded over replicas    its shard, on each replica (zero=3: the shards are disjoint),
                                         on tp rank 0 (on each tp rank where tp split it)
    any other parameter                  the whole, on the rank that trains it (`Pipeline.owner_of`:
                                         the first holder stage, its ZeRO owner replica, tp rank 0)

so one all-reduce of one number gives the whole model's squared norm on every rank. Every rank then
scales the gradients it holds by min(1, max_norm / (norm + 1e-6)), as torch does.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from plait.runtime.comm.collectives import sum_floats
from plait.runtime.pipeline import Pipeline

__all__ = ["counted_gradients", "squared_norm", "global_norm", "clip_to"]


def counted_gradients(pipe: Pipeline) -> list[torch.Tensor]:
    """The gradients this rank counts in the global norm (see the module's table)."""
    out = []
    wholes = {id(shard): whole for whole, shard in pipe.sharded.pairs} if pipe.sharded is not None else {}
    for p in pipe.local_parameters:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):  # zero=3: this replica's shard of the gradient (of a tp part: each tp rank's)
            if pipe.tp_rank == 0 or id(wholes.get(id(p))) in pipe.tp_parts:
                out.append(p.grad.to_local())
            continue
        part = pipe.tp_parts.get(id(p))
        if (pipe.rank in part[2]) if part is not None else pipe.owner_of.get(id(p)) == pipe.rank:
            out.append(p.grad)
    return out


def squared_norm(grads: list[torch.Tensor]) -> float:
    """The sum of the squares of `grads`' elements, in float64."""
    return float(sum(float(g.detach().double().pow(2).sum()) for g in grads))


def global_norm(pipe: Pipeline) -> float:
    """The 2-norm of the whole model's gradient, the same on every rank (a collective: every rank calls it)."""
    return math.sqrt(sum_floats([squared_norm(counted_gradients(pipe))])[0])


def clip_to(pipe: Pipeline, norm: float, max_norm: float) -> None:
    """Scale every gradient this rank holds by min(1, max_norm / (norm + 1e-6))."""
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    if coefficient < 1.0:
        for p in pipe.local_parameters:
            if p.grad is not None:
                p.grad.mul_(coefficient)
