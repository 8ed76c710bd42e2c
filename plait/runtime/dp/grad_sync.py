"""Data-parallel gradient synchronisation: buckets summed as soon as their gradients are final.

Each bucket is all-reduced, or with ZeRO-2 reduced to the owners of its parameters.

A stage's parameter gets one gradient contribution per micro-batch; it is final after the last
micro-batch's backward. A hook counts the contributions, and when every parameter of a bucket is
final the bucket is flattened and all-reduced asynchronously over the stage's replica group,
while the backward pass of the rest of the stage (and of later micro-batches of other stages)
goes on. Buckets are launched strictly in index order so every replica issues the same
collectives in the same order::

    backward of the last micro-batch:  layer 8 .. layer 5 | layer 4 .. layer 1
    buckets (reverse layer order):     [ bucket 0 ]--all-reduce--> [ bucket 1 ]--all-reduce-->
    finish(): wait for every bucket (each .grad is a view of its bucket: nothing to copy back)

The first bucket is small (FIRST_BUCKET_BYTES, as DistributedDataParallel does) so that an
all-reduce starts early in the backward pass whatever the cap.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from plait.cost.buckets import ALONE_BYTES, assign_buckets, reduces_to_owners
from plait.runtime.comm.waiting import finish

__all__ = ["GradientBuckets", "ALONE_BYTES"]



class GradientBuckets:
    """Sums the gradients of `params` over `group`, overlapping the backward pass: all-reduced,
    or with `owner_rank` (ZeRO-2: id(parameter) -> the rank that steps it) reduced to each owner.

    With owners, a bucket holds one flat buffer per owner (its parameters in bucket order): each is
    reduced to its owner (on gloo all-reduced, which it runs faster), and after `finish` the others'
    buffers are freed, so the optimizer step runs holding this rank's share of the gradients only
    (they come back at the next `prepare`).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, bucket_bytes: int,
                 timeout_s: float, owner_rank: dict[int, int] | None = None, rank: int = 0,
                 after_grad: Callable[[nn.Parameter, Callable[[torch.Tensor], None]], None] | None = None,
                 reduce_dtype: torch.dtype | None = None):
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.sharded = owner_rank is not None
        self.all_reduces = not reduces_to_owners(dist.get_backend(group))
        # Backward runs roughly in reverse order of the forward: fill buckets from the end.
        ordered = list(params)[::-1]
        self.buckets: list[list[nn.Parameter]] = [
            [ordered[i] for i in bucket]
            for bucket in assign_buckets([p.numel() * p.element_size() for p in ordered],
                                         [p.dtype for p in ordered], bucket_bytes)
        ]
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        # Each bucket's segments: (owner rank or None for all of them, its parameters). One flat buffer
        # per segment (a bucket holds one dtype); each parameter's .grad becomes a view into it at its
        # first gradient of a step, so autograd accumulates straight into the buffer that is reduced
        # in place (DistributedDataParallel's gradient_as_bucket_view). A parameter of ALONE_BYTES or
        # more is a segment of its own with no buffer: the gradient autograd made is reduced in place,
        # which saves copying it (a collective more costs less than the copy from that size up).
        self._segments = [_segments(b, owner_rank) for b in self.buckets]
        self._flats: list[list[torch.Tensor | None]] = [[None] * len(segs) for segs in self._segments]
        self._alone_at = {id(share[0]): (b, k) for b, segs in enumerate(self._segments)
                          for k, (_, share) in enumerate(segs) if len(share) == 1}
        self._view_of: dict[int, torch.Tensor] = {}
        self._allocate()
        self._counts: dict[int, int] = {}
        self._pending = [0] * len(self.buckets)
        self._expected = 0
        self._next = 0  # the next bucket to launch
        self.reduce_dtype = reduce_dtype  # the sums run in it (a copy of each buffer), None: in the gradients' own
        self._works: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (work, the buffer, what is summed)
        self.launched_during_backward = 0  # buckets of the last step launched from the hooks
        # each parameter's gradient, as it is accumulated (`after_grad`: where the stages compute with
        # low-precision copies, once it is added into the parameter's fp32 gradient)
        self._handles: list[Any] = []
        for p in ordered:
            if after_grad is not None:
                after_grad(p, self._on_grad)
            else:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))  # type: ignore[no-untyped-call]

    def _allocate(self) -> None:
        """A flat buffer for every segment of several parameters that has none (all at first; the
        others' after a ZeRO-2 step)."""
        for b, segs in enumerate(self._segments):
            for k, (_, share) in enumerate(segs):
                if self._flats[b][k] is None and len(share) > 1:
                    flat = torch.zeros(sum(p.numel() for p in share), dtype=share[0].dtype, device=share[0].device)
                    self._flats[b][k] = flat
                    for p, end in zip(share, _ends(share)):
                        self._view_of[id(p)] = flat[end - p.numel() : end].view_as(p)

    def _release(self) -> None:
        """ZeRO-2, once reduced: free the segments other ranks own (and their gradients)."""
        for b, segs in enumerate(self._segments):
            for k, (dst, share) in enumerate(segs):
                if dst is not None and dst != self.rank:
                    self._flats[b][k] = None
                    for p in share:
                        p.grad = None
                        self._view_of.pop(id(p), None)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param`'s gradient lives in a bucket."""
        return id(param) in self._bucket_of

    @property
    def held_bytes(self) -> int:
        """Bytes of the gradient buffers this rank holds now."""
        return sum(f.numel() * f.element_size() for flats in self._flats for f in flats if f is not None)

    def prepare(self, num_microbatches: int, keep_grads: bool = False) -> None:
        """Start a step whose stage runs `num_microbatches` backward passes (`keep_grads`: the last
        batch of an accumulation, its parameters' gradients so far adopted into the buckets)."""
        self._expected = num_microbatches
        self._counts.clear()
        self._pending = [len(b) for b in self.buckets]
        self._next = 0
        self._works.clear()
        self.launched_during_backward = 0
        self._allocate()
        # No zeroing: the first gradient of a step is copied into its view (`_adopt`), later ones
        # accumulate into it in place -- one pass over the buffer instead of zero + add.
        for b in self.buckets if not keep_grads else ():
            for p in b:
                p.grad = None
        for alone, (index, k) in self._alone_at.items():  # the last step's gradient goes; this step's is adopted
            self._flats[index][k] = None
            self._view_of.pop(alone, None)

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._expected == 0:
            return  # not a data-parallel step (evaluation, or a backward outside fit)
        count = self._counts.get(id(param), 0) + 1
        self._counts[id(param)] = count
        if count == 1:
            self._adopt(param)
        if count == self._expected:
            self._pending[self._bucket_of[id(param)]] -= 1
            before = self._next
            self._launch_ready()
            self.launched_during_backward += self._next - before

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _adopt(self, param: torch.Tensor) -> None:
        """Move `param`'s gradient into its view of the bucket, so later ones accumulate there (a
        parameter alone in its segment: its gradient becomes the segment's buffer)."""
        if id(param) in self._alone_at and id(param) not in self._view_of:
            self._own(param, *self._alone_at[id(param)])
            return
        view = self._view_of[id(param)]
        if param.grad is not view:
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad)
            param.grad = view

    def _own(self, param: torch.Tensor, b: int, k: int) -> None:
        """The gradient autograd made for `param` (zeros where it has none) as segment k of bucket
        b, reduced in place; copied into a buffer of its own if it is not contiguous."""
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if not grad.is_contiguous():
            grad = grad.contiguous()
        param.grad = grad
        self._flats[b][k] = grad.view(-1)
        self._view_of[id(param)] = grad

    def _launch(self, index: int) -> None:
        for p in self.buckets[index]:
            self._adopt(p)  # a parameter without a gradient (unused this step) counts as zero
        for (dst, _), flat in zip(self._segments[index], self._flats[index]):
            assert flat is not None  # allocated at `prepare`
            summed = flat if self.reduce_dtype in (None, flat.dtype) else flat.to(self.reduce_dtype)
            if dst is None or self.all_reduces:
                work = dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            else:
                work = dist.reduce(summed, dst, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._works.append((work, flat, summed))

    def flush(self) -> None:
        """Launch every bucket not launched yet (parameters without a gradient count as zero).

        Called after the backward pass and before any other collective of the step: the group may
        be the default one (`make_group`), and a replica with no rows, whose hooks never ran, must
        still issue its buckets in the same order as the others."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1

    def finish(self) -> None:
        """Launch what is left, then wait for every bucket (ZeRO-2: then free the others' shares)."""
        self.flush()
        for work, flat, summed in self._works:
            finish(work, self.timeout)
            if summed is not flat:  # summed in reduce_dtype: back into the gradients' buffer
                flat.copy_(summed)
        self._works.clear()
        self._expected = 0
        if self.sharded:
            self._release()

    def remove(self) -> None:
        """Detach the hooks from the parameters."""
        for h in self._handles:
            h.remove()


def _segments(bucket: Sequence[nn.Parameter],
              owner_rank: dict[int, int] | None) -> list[tuple[int | None, list[nn.Parameter]]]:
    """A bucket's segments, in an order every replica shares: per owner (None: no owners, all-reduced),
    each parameter of ALONE_BYTES or more alone, then the smaller ones together."""
    owners = [None] if owner_rank is None else list(dict.fromkeys(owner_rank[id(p)] for p in bucket))
    out: list[tuple[int | None, list[nn.Parameter]]] = []
    for dst in owners:
        share = [p for p in bucket if owner_rank is None or owner_rank[id(p)] == dst]
        large = [p for p in share if p.numel() * p.element_size() >= ALONE_BYTES]
        small = [p for p in share if p.numel() * p.element_size() < ALONE_BYTES]
        out += [(dst, [p]) for p in large] + ([(dst, small)] if small else [])
    return out


def _ends(params: Sequence[nn.Parameter]) -> list[int]:
    """Where each parameter's gradient ends in its bucket's flat buffer."""
    ends, end = [], 0
    for p in params:
        end += p.numel()
        ends.append(end)
    return ends
