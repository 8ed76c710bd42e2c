"""`Layout`: which tensors of a message travel in one shared buffer, and where each lies in it.

Every isend and irecv costs more than its bytes: gloo wakes a thread on each side for it, and on
a CPU rank that thread takes its time from the compute (a 40-byte message of its own each way
cost a two-rank pipeline step 0.2-0.9 ms, docs/benchmarks.md). So a message's small tensors travel
together in one byte buffer, each at an aligned offset, and are copied out of it on arrival:

    tensors   a (64 KiB)   b (40 B)   c (8 MiB)          sent: c alone, then [a|pad|b]
    layout    alone (2,)   packed ((0, 0), (1, 65536))   nbytes 65576

A tensor above `PACK_BYTES` goes alone (copying it would cost more than a message saves), and so
does a message's only small tensor (nothing to share a buffer with: no copy). Both peers compute
the layout from the same (dtype, shape) list, so they agree on it without saying so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["PACK_BYTES", "Layout", "layout", "pack", "receive_buffers", "unpack"]

PACK_BYTES = 2**20  # a copy of 1 MiB: ~0.1 ms on a CPU core, ~1 us on a GPU; a message costs more
_ALIGN = 16  # every packed tensor starts at a multiple of the widest element (complex128)

Spec = tuple[torch.dtype, tuple[int, ...]]  # a tensor's dtype and shape (in the order it travels)


@dataclass(frozen=True)
class Layout:
    """How a list of tensors travels: some alone, the rest at byte offsets of one buffer."""

    alone: tuple[int, ...]  # indices of the tensors sent as they are, in order
    packed: tuple[tuple[int, int], ...]  # (index, byte offset) of each tensor in the shared buffer
    nbytes: int  # the shared buffer's size (0: there is none)


def _nbytes(spec: Spec) -> int:
    dtype, shape = spec
    return math.prod(shape) * dtype.itemsize


def layout(specs: Sequence[Spec]) -> Layout:
    """The layout of tensors of these (dtype, shape)s: the small ones share a buffer if two or more."""
    sizes = [_nbytes(s) for s in specs]
    small = [i for i, n in enumerate(sizes) if n <= PACK_BYTES]
    if len(small) < 2:
        return Layout(tuple(range(len(specs))), (), 0)
    packed, offset = [], 0
    for i in small:
        packed.append((i, offset))
        offset += -(-sizes[i] // _ALIGN) * _ALIGN
    return Layout(tuple(i for i in range(len(specs)) if i not in set(small)), tuple(packed), offset)


def pack(tensors: Sequence[torch.Tensor], plan: Layout) -> list[torch.Tensor]:
    """What to send for `tensors` (each contiguous in the order it travels): the lone tensors, then
    the shared buffer, if any."""
    out = [tensors[i] for i in plan.alone]
    if plan.nbytes:
        buffer = torch.empty(plan.nbytes, dtype=torch.uint8, device=tensors[plan.packed[0][0]].device)
        for i, offset in plan.packed:
            t = tensors[i]
            buffer[offset:offset + t.nbytes].view(t.dtype).copy_(t.reshape(-1))
        out.append(buffer)
    return out


def receive_buffers(specs: Sequence[Spec], plan: Layout, device: torch.device) -> list[torch.Tensor]:
    """Empty buffers to receive what `pack` sends for tensors of these specs."""
    out = [torch.empty(specs[i][1], dtype=specs[i][0], device=device) for i in plan.alone]
    if plan.nbytes:
        out.append(torch.empty(plan.nbytes, dtype=torch.uint8, device=device))
    return out


def unpack(buffers: Sequence[torch.Tensor], specs: Sequence[Spec], plan: Layout) -> list[torch.Tensor]:
    """The tensors, in their order, from the received `buffers`. A packed one is copied out of the
    shared buffer: a view of it would share one storage with tensors of other dtypes, which
    `torch.save` refuses, and would keep the whole buffer alive for as long as any one of them."""
    out: list[torch.Tensor | None] = [None] * len(specs)
    for i, b in zip(plan.alone, buffers):
        out[i] = b
    if plan.nbytes:
        shared = buffers[len(plan.alone)]
        for i, offset in plan.packed:
            dtype, shape = specs[i]
            out[i] = shared[offset:offset + _nbytes(specs[i])].view(dtype).view(shape).clone()
    assert all(t is not None for t in out), "a layout covers every tensor"
    return out  # type: ignore[return-value]
