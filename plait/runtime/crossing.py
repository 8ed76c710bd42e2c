"""`Crossing`: a stage output and its gradient between two stages of different tp widths, tile by tile.

Stage s (a ranks) and stage s + 1 (b ranks, b != a) both hold the value whole on each of their
tp ranks. Forward, each sender sends each of its receivers (`plait.plan.tiles.TileMap`) one
message: the values, each large floating-point tensor replaced by its tile (the tensor flattened
in memory order, then the tile's elements), with the shapes it is rebuilt from::

    [values with each cut tensor a 0, [tile of each cut tensor], [position, ndim, *shape, *order, ...]]

The receiver writes the tiles it got into the whole tensors and its stage all-gathers the rest
locally (the tp group of stage s + 1). Backward, the gradient message of each pair holds, as the
wire expects for what was sent (`Wire.post_recv_grads`), the gradients of the message's leaves that
require grad in their order: the whole ones, then the tiles; stage s all-gathers its tiles.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from plait.plan.tiles import TileMap
from plait.runtime.wire import Wire, dim_order, inverse_order

__all__ = ["Crossing"]


class Crossing:
    """The boundary after stage `boundary` as one rank of either side sees it."""

    def __init__(self, boundary: int, senders: Sequence[int], receivers: Sequence[int], rank: int, group: Any) -> None:
        self.boundary = boundary
        self.senders, self.receivers = list(senders), list(receivers)  # each stage's ranks, in tp order
        self.tiles = TileMap(len(self.senders), len(self.receivers))
        self.sending = rank in self.senders
        assert self.sending or rank in self.receivers, f"rank {rank} is on neither side of boundary {boundary}"
        self.me = (self.senders if self.sending else self.receivers).index(rank)
        self.group = group  # this rank's stage's tp group (None: the stage has one rank)

    @property
    def peers(self) -> list[int]:
        """The ranks of the other stage this rank exchanges messages with (the same both ways)."""
        if self.sending:
            return [self.receivers[j] for j in self.tiles.receivers_of(self.me)]
        return [self.senders[i] for i in self.tiles.senders_of(self.me)]

    def _pair_tiles(self) -> list[int]:
        """The tile of each pair this rank is in, in `peers` order."""
        if self.sending:
            return [self._tile(self.me, j) for j in self.tiles.receivers_of(self.me)]
        return [self._tile(i, self.me) for i in self.tiles.senders_of(self.me)]

    def _tile(self, sender: int, receiver: int) -> int:
        k = self.tiles.tile(sender, receiver)
        assert k is not None
        return k

    def _cuts(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and self.tiles.cuts(x.numel())

    # -- forward: activations ------------------------------------------------------------------

    def send_forward(self, values: list[Any], wire: Wire, key: Hashable, tag: int, rows: int = 0) -> None:
        """Send this sender's tiles of `values` to its receivers (`rows`: unused, as every rank of
        either stage holds the whole micro-batch)."""
        leaves, spec = pytree.tree_flatten([tuple(v) if isinstance(v, torch.Size) else v for v in values])
        for peer, k in zip(self.peers, self._pair_tiles()):
            skeleton, tiles, meta = [], [], []
            for position, x in enumerate(leaves):
                if not self._cuts(x):
                    skeleton.append(x)
                    continue
                order = dim_order(x)
                lo, hi = self.tiles.bounds(x.numel(), k)
                tiles.append(x.detach().permute(order).reshape(-1)[lo:hi].requires_grad_(x.requires_grad))
                meta += [position, x.dim(), *x.shape, *order]
                skeleton.append(0)
            wire.send([pytree.tree_unflatten(skeleton, spec), tiles, meta], peer, key, tag)

    def post_forward(self, wire: Wire, key: Hashable, tag: int) -> bool:
        """Post ahead the receives of every sender's message (False: a description is not known yet)."""
        return all([wire.post_recv(peer, key, tag) for peer in self.peers])

    def recv_forward(self, wire: Wire, key: Hashable, tag: int) -> list[Any]:
        """The whole values: this receiver's tiles from their senders, the rest all-gathered locally."""
        messages = [wire.recv(peer, key, tag)[0] for peer in self.peers]
        skeleton, first_tiles, meta = messages[0]
        leaves, spec = pytree.tree_flatten(skeleton)
        i, cut = 0, 0
        while i < len(meta):
            position, ndim = meta[i], meta[i + 1]
            shape, order = meta[i + 2: i + 2 + ndim], meta[i + 2 + ndim: i + 2 + 2 * ndim]
            i += 2 + 2 * ndim
            like = first_tiles[cut]
            numel = 1
            for size in shape:
                numel *= size
            flat = torch.empty(numel, dtype=like.dtype, device=like.device)
            for message, k in zip(messages, self._pair_tiles()):
                lo, hi = self.tiles.bounds(numel, k)
                flat[lo:hi] = message[1][cut].detach()
            if self.tiles.gathers:
                _all_gather(flat, self.tiles, self.me, self.group)
            whole = flat.view([shape[d] for d in order]).permute(inverse_order(order))
            leaves[position] = whole.requires_grad_() if like.requires_grad else whole
            cut += 1
        return list(pytree.tree_unflatten(leaves, spec))

    # -- backward: gradients of the activations ------------------------------------------------

    def send_backward(self, grads: list[torch.Tensor], wire: Wire, tag: int, key: Hashable = None) -> None:
        """Send each sender the gradients of what it sent: the whole small ones, its tile of the rest."""
        whole = [g for g in grads if not self._cuts(g)]
        cut = [g.detach().contiguous().reshape(-1) for g in grads if self._cuts(g)]
        for peer, k in zip(self.peers, self._pair_tiles()):
            wire.send_tensors(whole + [g[slice(*self.tiles.bounds(g.numel(), k))] for g in cut], peer, tag)

    def post_backward(self, wire: Wire, key: Hashable, tag: int) -> bool:
        """Post ahead the receives of every receiver's gradients (False: not sent to it yet)."""
        return all([wire.post_recv_grads(peer, key, tag) for peer in self.peers])

    def recv_backward(self, like: list[torch.Tensor], wire: Wire, tag: int, key: Hashable = None) -> list[torch.Tensor]:
        """The whole gradients of `like` (what this sender sent that requires grad): its tiles from
        its receivers, the rest all-gathered over its own stage (`key`: unused, the tiles follow
        from `like`)."""
        whole = [t for t in like if not self._cuts(t)]
        cut = [t for t in like if self._cuts(t)]
        pairs = list(zip(self.peers, self._pair_tiles()))
        flats = [torch.empty(t.numel(), dtype=t.dtype, device=t.device) for t in cut]
        got: list[torch.Tensor] = []
        for n, (peer, k) in enumerate(pairs):
            shapes = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in whole] + [
                torch.empty(_size(self.tiles.bounds(t.numel(), k)), dtype=t.dtype, device=t.device) for t in cut]
            message = wire.recv_tensors(shapes, peer, tag)
            if n == 0:
                got = message[:len(whole)]
            for flat, tile in zip(flats, message[len(whole):]):
                flat[slice(*self.tiles.bounds(flat.numel(), k))] = tile
        back = self.tiles.reversed()
        if back.gathers:
            for flat in flats:
                _all_gather(flat, back, self.me, self.group)
        whole_grads, cut_grads = iter(got), iter(flat.view(t.shape) for flat, t in zip(flats, cut))
        return [next(cut_grads) if self._cuts(t) else next(whole_grads) for t in like]


def _size(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]




def _all_gather(flat: torch.Tensor, tiles: TileMap, me: int, group: Any) -> None:
    """Fill `flat` in place: receiver `me` holds the tiles `tiles.held(me)`; its stage (`group`, the
    receivers in order) all-gathers every receiver's tiles, each padded to the longest share."""
    numel = flat.numel()
    shares = [[tiles.bounds(numel, k) for k in tiles.held(m)] for m in range(tiles.receivers)]
    sizes = [sum(hi - lo for lo, hi in share) for share in shares]
    mine = torch.zeros(max(sizes), dtype=flat.dtype, device=flat.device)
    mine[:sizes[me]] = torch.cat([flat[lo:hi] for lo, hi in shares[me]])
    out = [torch.empty_like(mine) for _ in shares]
    dist.all_gather(out, mine, group=group)
    for share, got in zip(shares, out):
        offset = 0
        for lo, hi in share:
            flat[lo:hi] = got[offset: offset + hi - lo]
            offset += hi - lo
