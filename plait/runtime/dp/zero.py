"""`ShardedOptimizerState`: the optimizer state of a stage sharded over its replicas (ZeRO stage 1).

With dp replicas of a stage, each replica steps only its share of the stage's parameters, so
each holds only that share's optimizer state (Adam: 2 x its bytes), then every replica's updated
share is broadcast to the others (Rajbhandari et al. 2020, ZeRO-1)::

    gradients all-reduced (as without ZeRO)       replica 0: [p0 p1 | p2 p3 p4]   owns p0, p1
    each replica drops the others' gradients      replica 1: [p0 p1 | p2 p3 p4]   owns p2, p3, p4
    optimizer.step(): torch steps only parameters with a gradient and makes their state then
    owners broadcast their updated parameters: large ones in place, the rest in one flat buffer

Parameters are shared out whole (greedily, largest first, to the replica with the fewest bytes,
ties to the lowest), so a checkpoint stays keyed by name and loads into any layout: each
parameter's optimizer state is saved by the rank that owns it. A parameter tied over several
stages (summed by `TiedGradients`) is not sharded: every holder steps it, as without ZeRO.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from plait.runtime.comm.collectives import broadcast_tensors
from plait.tensor_parts import whole_shape

__all__ = ["ShardedOptimizerState", "share_out", "zero_owners"]


def share_out(sizes: Sequence[int], replicas: int) -> list[int]:
    """The replica of each parameter (by its number of bytes): whole parameters, balanced."""
    load = [0] * replicas
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def zero_owners(position_params: Sequence[Sequence[nn.Parameter]], replicas: int) -> dict[int, int]:
    """id(parameter) -> its owning replica, for the sharded parameters of every pipeline position
    (each rank computes all of them, so a checkpoint's index agrees everywhere: sized by their
    whole shapes, which a tp-cut stage and the ranks of another stage agree on)."""
    out: dict[int, int] = {}
    for params in position_params:
        for p, r in zip(params, share_out([math.prod(whole_shape(p)) * p.element_size() for p in params], replicas)):
            out[id(p)] = r
    return out


class ShardedOptimizerState:
    """This rank's share of its stage's parameters, and the broadcasts that keep replicas equal."""

    def __init__(self, params: Sequence[nn.Parameter], owners: dict[int, int], replica_ranks: Sequence[int],
                 rank: int, group: Any):
        self.params = list(params)  # this rank's sharded parameters, in the same order on every replica
        self.ranks = list(replica_ranks)  # the rank of each replica of this stage
        self.group = group
        self.owner_rank = {id(p): self.ranks[owners[id(p)]] for p in self.params}
        self.rank = rank
        # Fixed for the pipeline's life: the others' parameters, and each owner's share by dtype.
        self._foreign = [p for p in self.params if self.owner_rank[id(p)] != rank]
        self._shares = [(src, share) for src in self.ranks
                        if (share := [p for p in self.params if self.owner_rank[id(p)] == src])]

    def owned(self, p: nn.Parameter) -> bool:
        """Whether this rank steps `p` (parameters not sharded count as owned)."""
        return self.owner_rank.get(id(p), self.rank) == self.rank

    def drop_foreign_gradients(self) -> None:
        """Before the optimizer step: no gradient, so no step and no state, for others' parameters."""
        for p in self._foreign:
            p.grad = None

    def broadcast(self) -> None:
        """After the optimizer step: every owner's updated parameters to the other replicas."""
        for src, share in self._shares:
            broadcast_tensors(share, src, self.group, chunk_bytes=2**62)  # large ones in place, the rest one buffer
