"""`Crossing`: a stage output and its gradient between two stages of different tp widths, tile by tile.

Stage s (a ranks) and stage s + 1 (b ranks, b != a) both hold the value whole on each of their
tp ranks. Forward, each sender sends each of its receivers (`plait.cost.tiles.TileMap`) one
message: the values, each large floating-point tensor replaced by its tile (the tensor flattened
in memory order, then the tile's elements), with the shapes it is rebuilt from::

    [values with each cut tensor a 0, [tile of each cut tensor], [position, ndim, *shape, *order, ...]]

The receiver writes the tiles it got into the whole tensors and its stage all-gathers the rest
locally (the tp group of stage s + 1). Backward, each pair's gradient message holds the gradients
of the leaves that required grad, in their order: the whole ones, then the tiles of the
gradients' map (`TileMap.reversed`); stage s all-gathers its tiles. The crossing posts those
receives itself (their sizes follow from what it sent, not from the message's description).
With `whole` (`Config.crossing="whole"`) every receiver gets all the tiles, and nothing is
gathered on either side.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from plait.cost.tiles import TileMap
from plait.runtime.comm.waiting import finish
from plait.runtime.comm.wire import Wire, dim_order, inverse_order

__all__ = ["Crossing"]


class Crossing:
    """The boundary after stage `boundary` as one rank of either side sees it (`whole`: every
    receiver gets the whole value and nothing is gathered, `TileMap.whole`)."""

    def __init__(self, boundary: int, senders: Sequence[int], receivers: Sequence[int], rank: int, group: Any,
                 whole: bool = False) -> None:
        self.boundary = boundary
        self.senders, self.receivers = list(senders), list(receivers)  # each stage's ranks, in tp order
        self.tiles = TileMap(len(self.senders), len(self.receivers), whole)  # forward
        self.back = self.tiles.reversed()  # the gradients: receivers to senders
        self.sending = rank in self.senders
        assert self.sending or rank in self.receivers, f"rank {rank} is on neither side of boundary {boundary}"
        self.me = (self.senders if self.sending else self.receivers).index(rank)
        self.group = group  # this rank's stage's tp group (None: the stage has one rank)
        self._sent: dict[Hashable, list[torch.Tensor]] = {}  # per key: what was sent that requires grad (meta)

    @property
    def peers(self) -> list[int]:
        """The ranks of the other stage this rank exchanges messages with (the same both ways)."""
        return [peer for peer, _ in self._pairs(backward=False)]

    def _pairs(self, backward: bool) -> list[tuple[int, int]]:
        """(peer rank, tile) of each message this rank sends or receives, forward or backward."""
        tiles = self.back if backward else self.tiles
        out_side, in_side = (self.receivers, self.senders) if backward else (self.senders, self.receivers)
        if self.sending != backward:  # this rank sends in this direction
            return [(in_side[j], _tile(tiles, self.me, j)) for j in tiles.receivers_of(self.me)]
        return [(out_side[i], _tile(tiles, i, self.me)) for i in tiles.senders_of(self.me)]

    def _cuts(self, x: Any, tiles: TileMap) -> bool:
        return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and tiles.cuts(x.numel())

    # -- forward: activations ------------------------------------------------------------------

    def send_forward(self, values: list[Any], wire: Wire, key: Hashable, tag: int, rows: int = 0) -> None:
        """Send this sender's tiles of `values` to its receivers (`rows`: unused, as every rank of
        either stage holds the whole micro-batch)."""
        leaves, spec = pytree.tree_flatten([tuple(v) if isinstance(v, torch.Size) else v for v in values])
        self._sent[key] = [x.new_empty(x.shape, device="meta") for x in leaves
                           if isinstance(x, torch.Tensor) and x.requires_grad]  # shapes only: no activation kept
        for peer, k in self._pairs(backward=False):
            skeleton, tiles, meta = [], [], []
            for position, x in enumerate(leaves):
                if not self._cuts(x, self.tiles):
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
        return all([wire.post_recv(peer, key, tag) for peer, _ in self._pairs(backward=False)])

    def recv_forward(self, wire: Wire, key: Hashable, tag: int) -> list[Any]:
        """The whole values: this receiver's tiles from their senders, the rest all-gathered locally."""
        pairs = self._pairs(backward=False)
        messages = [wire.recv(peer, key, tag)[0] for peer, _ in pairs]
        skeleton, first_tiles, meta = messages[0]
        leaves, spec = pytree.tree_flatten(skeleton)
        i, cut = 0, 0
        while i < len(meta):
            position, ndim = meta[i], meta[i + 1]
            shape, order = meta[i + 2: i + 2 + ndim], meta[i + 2 + ndim: i + 2 + 2 * ndim]
            i += 2 + 2 * ndim
            like = first_tiles[cut]
            flat = torch.empty(math.prod(shape), dtype=like.dtype, device=like.device)
            for message, (_, k) in zip(messages, pairs):
                lo, hi = self.tiles.bounds(flat.numel(), k)
                flat[lo:hi] = message[1][cut].detach()
            if self.tiles.gathers:
                _all_gather(flat, self.tiles, self.me, self.group)
            whole = flat.view([shape[d] for d in order]).permute(inverse_order(order))
            leaves[position] = whole.requires_grad_() if like.requires_grad else whole
            cut += 1
        return list(pytree.tree_unflatten(leaves, spec))

    # -- backward: gradients of the activations ------------------------------------------------

    def send_backward(self, grads: list[torch.Tensor], wire: Wire, tag: int, key: Hashable = None) -> None:
        """Send each sender the gradients of what it sent: the whole small ones, this receiver's
        tile of the rest (of the gradients' map, `back`)."""
        whole = [g for g in grads if not self._cuts(g, self.back)]
        cut = [g.detach().contiguous().reshape(-1) for g in grads if self._cuts(g, self.back)]
        for peer, k in self._pairs(backward=True):
            wire.send_tensors(whole + [g[slice(*self.back.bounds(g.numel(), k))] for g in cut], peer, tag)

    def _grad_buffers(self, like: list[torch.Tensor], k: int, device: torch.device) -> list[torch.Tensor]:
        """Buffers of one receiver's gradient message for `like`: whole ones, then tile k of the rest."""
        whole = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in like if not self._cuts(t, self.back)]
        return whole + [torch.empty(_size(self.back.bounds(t.numel(), k)), dtype=t.dtype, device=device)
                        for t in like if self._cuts(t, self.back)]

    def post_backward(self, wire: Wire, key: Hashable, tag: int) -> bool:
        """Post ahead the receives of every receiver's gradients (False: nothing sent for `key` yet)."""
        like = self._sent.get(key)
        if like is None:
            return False
        for peer, k in self._pairs(backward=True):
            wire.post_tensors(self._grad_buffers(like, k, wire.device), peer, tag)
        return True

    def recv_backward(self, like: list[torch.Tensor], wire: Wire, tag: int, key: Hashable = None) -> list[torch.Tensor]:
        """The whole gradients of `like` (what this sender sent that requires grad): its tiles from
        its receivers, the rest all-gathered over its own stage (`key`: unused, the tiles follow
        from `like`)."""
        whole = [t for t in like if not self._cuts(t, self.back)]
        cut = [t for t in like if self._cuts(t, self.back)]
        flats = [torch.empty(t.numel(), dtype=t.dtype, device=t.device) for t in cut]
        got: list[torch.Tensor] = []
        for n, (peer, k) in enumerate(self._pairs(backward=True)):
            message = wire.recv_tensors(self._grad_buffers(like, k, wire.device), peer, tag)
            if n == 0:
                got = message[:len(whole)]
            for flat, tile in zip(flats, message[len(whole):]):
                flat[slice(*self.back.bounds(flat.numel(), k))] = tile
        if self.back.gathers:
            for flat in flats:
                _all_gather(flat, self.back, self.me, self.group)
        whole_grads, cut_grads = iter(got), iter(flat.view(t.shape) for flat, t in zip(flats, cut))
        return [next(cut_grads) if self._cuts(t, self.back) else next(whole_grads) for t in like]


def _tile(tiles: TileMap, sender: int, receiver: int) -> int:
    k = tiles.tile(sender, receiver)
    assert k is not None
    return k


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
    finish(dist.all_gather(out, mine, group=group, async_op=True))
    for share, got in zip(shares, out):
        offset = 0
        for lo, hi in share:
            flat[lo:hi] = got[offset: offset + hi - lo]
            offset += hi - lo
