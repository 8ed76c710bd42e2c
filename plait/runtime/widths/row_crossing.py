"""`RowCrossing`: a stage output and its gradient between two stages of different dp widths, by row blocks.

Stage s (a replicas) and stage s + 1 (b replicas, b != a) each run equal blocks of every
micro-batch's rows (`plait.cost.row_blocks`). Forward, each sender sends each receiver whose
block overlaps its own one message: the values with each batch-major tensor cut to the rows
they share, and one flag per leaf saying which were cut::

    [values with each batch-major tensor cut to the shared rows, [1 if cut else 0 per leaf]]

The receiver joins the cut tensors of its senders in row order and takes the others (values
that do not depend on the row, as a rotary embedding's cos/sin: equal on every replica) from its
first sender. Backward, each pair's gradient message holds, as the wire expects for what was
sent (`Wire.post_recv_grads`), the gradients of the message's leaves that require grad: the
shared rows of the cut ones, and for the others the receiver's whole gradient to its first
sender and zeros to the rest, so the senders' gradients of such a value add up to the one-process
gradient once each stage sums its parameters' gradients over its replicas. At (2, 1)::

    rank 0 (rows 0:2) --F--> rank 2 (rows 0:4: joined) --B rows 0:2--> rank 0
    rank 1 (rows 2:4) --F--> rank 2                    --B rows 2:4--> rank 1

A value is batch-major where the capture says its first dimension is the symbolic batch size
(`meta["val"]`, torch.export); where the capture does not say (torch.fx), where its first
dimension equals the sender's rows.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from plait.cost.row_blocks import RowMap, row_block
from plait.errors import ConfigError
from plait.runtime.comm.wire import Wire, inverse_order

__all__ = ["RowCrossing", "batch_major"]


def batch_major(module: fx.GraphModule) -> list[bool | None]:
    """Per value a stage sends: whether its first dimension is the batch (None: the capture does not
    say, or the value is not one tensor)."""
    out = next((n for n in module.graph.nodes if n.op == "output"), None)
    values = out.args[0] if out is not None else ()
    found: list[bool | None] = []
    for value in values if isinstance(values, (list, tuple)) else (values,):
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            found.append(None)
        else:
            found.append(val.dim() > 0 and not isinstance(val.shape[0], int))
    return found


class RowCrossing:
    """The boundary after stage `boundary` between stages of different dp, as one rank of either side sees it."""

    def __init__(self, boundary: int, senders: Sequence[int], receivers: Sequence[int], rank: int,
                 batched: Sequence[bool | None]) -> None:
        self.boundary = boundary
        self.senders, self.receivers = list(senders), list(receivers)  # each stage's ranks, in replica order
        self.rows = RowMap(len(self.senders), len(self.receivers))
        self.sending = rank in self.senders
        assert self.sending or rank in self.receivers, f"rank {rank} is on neither side of boundary {boundary}"
        self.me = (self.senders if self.sending else self.receivers).index(rank)
        self.batched = list(batched)  # per value sent: batch-major (None: judged by its rows)
        self._flags: dict[Hashable, list[int]] = {}  # message key -> per grad leaf: 1 if cut by rows

    @property
    def peers(self) -> list[int]:
        """The ranks of the other stage this rank exchanges messages with (the same both ways)."""
        if self.sending:
            return [self.receivers[j] for j in self.rows.receivers_of(self.me)]
        return [self.senders[i] for i in self.rows.senders_of(self.me)]

    def _pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver) replica indices of each pair this rank is in, in `peers` order."""
        if self.sending:
            return [(self.me, j) for j in self.rows.receivers_of(self.me)]
        return [(i, self.me) for i in self.rows.senders_of(self.me)]

    def _local(self, pair: tuple[int, int], rows: int) -> slice:
        """The rows a pair shares, as a slice of this rank's own block of a micro-batch of `rows`."""
        lo, hi = self.rows.overlap(pair[0], pair[1], rows)
        mine = len(self.senders if self.sending else self.receivers)
        start = row_block(rows, mine, self.me)[0]
        return slice(lo - start, hi - start)

    # -- forward: activations ------------------------------------------------------------------

    def _cut_flags(self, values: list[Any], share: int) -> list[int]:
        """Per leaf of `values`: 1 where it is a batch-major tensor of this sender's `share` rows."""
        flags = []
        for value, batched in zip(values, self.batched + [None] * (len(values) - len(self.batched))):
            for x in pytree.tree_leaves(tuple(value) if isinstance(value, torch.Size) else value):
                tensor = isinstance(x, torch.Tensor) and x.dim() > 0
                if batched and isinstance(value, torch.Tensor) and tensor and x.shape[0] != share:
                    raise ConfigError(
                        f"stage {self.boundary} sends a tensor of shape {list(x.shape)} whose first dimension "
                        f"grows with the batch but is not the {share} rows of this replica; stage_dp can "
                        f"cut only batch-major values there: move the cut (layers_per_stage) or give one dp")
                cut = bool(batched) if batched is not None and isinstance(value, torch.Tensor) else \
                    tensor and x.shape[0] == share
                flags.append(int(cut))
        return flags

    def send_forward(self, values: list[Any], wire: Wire, key: Hashable, tag: int, rows: int) -> None:
        """Send this sender's rows of `values` (a micro-batch of `rows` rows) to its receivers."""
        share = rows // len(self.senders)
        flags = self._cut_flags(values, share)
        leaves, spec = pytree.tree_flatten([tuple(v) if isinstance(v, torch.Size) else v for v in values])
        self._flags[key] = [f for f, x in zip(flags, leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        for peer, pair in zip(self.peers, self._pairs()):
            part = self._local(pair, rows)
            cut = [x.detach()[part].requires_grad_(x.requires_grad) if f else x for f, x in zip(flags, leaves)]
            wire.send([pytree.tree_unflatten(cut, spec), flags], peer, key, tag)

    def post_forward(self, wire: Wire, key: Hashable, tag: int) -> bool:
        """Post ahead the receives of every sender's message (False: a description is not known yet)."""
        return all([wire.post_recv(peer, key, tag) for peer in self.peers])

    def recv_forward(self, wire: Wire, key: Hashable, tag: int) -> list[Any]:
        """The values of this receiver's rows: its senders' rows joined, the rest from the first."""
        received = [wire.recv(peer, key, tag) for peer in self.peers]
        messages, orders = [m for m, _ in received], received[0][1].orders  # the first sender's layout
        flags = [int(f) for f in messages[0][1]]
        parts = [pytree.tree_flatten(m[0])[0] for m in messages]
        leaves, spec = pytree.tree_flatten(messages[0][0])
        for position, cut in enumerate(flags):
            if not cut:
                continue
            pieces = [p[position] for p in parts]
            first = pieces[0]
            order = orders[position]  # as sent (a one-row piece's strides would not tell)
            shape = [sum(p.shape[0] for p in pieces), *first.shape[1:]]
            whole = torch.empty([shape[d] for d in order], dtype=first.dtype, device=first.device).permute(
                inverse_order(order))  # the sender's memory order, as the wire rebuilds it
            start = 0
            for piece in pieces:
                whole[start:start + piece.shape[0]] = piece.detach()
                start += piece.shape[0]
            leaves[position] = whole.requires_grad_() if first.requires_grad else whole
        self._flags[key] = [f for f, x in zip(flags, leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        return list(pytree.tree_unflatten(leaves, spec))

    # -- backward: gradients of the activations ------------------------------------------------

    def send_backward(self, grads: list[torch.Tensor], wire: Wire, tag: int, key: Hashable) -> None:
        """Send each sender the gradients of what it sent: its rows of the cut values, and of the
        others this receiver's whole gradient to the first sender, zeros to the rest."""
        flags = self._flags[key]
        rows = next((g.shape[0] * len(self.receivers) for f, g in zip(flags, grads) if f), 0)
        for n, (peer, pair) in enumerate(zip(self.peers, self._pairs())):
            out = [g.detach()[self._local(pair, rows)].contiguous() if f else
                   (g if n == 0 else torch.zeros_like(g)) for f, g in zip(flags, grads)]
            wire.send_tensors(out, peer, tag)

    def post_backward(self, wire: Wire, key: Hashable, tag: int) -> bool:
        """Post ahead the receives of every receiver's gradients (False: not sent to it yet)."""
        return all([wire.post_recv_grads(peer, key, tag) for peer in self.peers])

    def recv_backward(self, like: list[torch.Tensor], wire: Wire, tag: int, key: Hashable) -> list[torch.Tensor]:
        """The gradients of `like` (what this sender sent that requires grad): its rows of the cut
        ones from the receivers that hold them, the others summed over its receivers."""
        flags = self._flags[key]
        rows = next((t.shape[0] * len(self.senders) for f, t in zip(flags, like) if f), 0)
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if f else torch.zeros(
            t.shape, dtype=t.dtype, device=t.device) for f, t in zip(flags, like)]
        for peer, pair in zip(self.peers, self._pairs()):
            part = self._local(pair, rows)
            shapes = [torch.empty(o[part].shape if f else o.shape, dtype=o.dtype, device=o.device)
                      for f, o in zip(flags, out)]
            for f, o, g in zip(flags, out, wire.recv_tensors(shapes, peer, tag)):
                if f:
                    o[part] = g
                else:
                    o += g
        return out
