"""How a tensor split over the ranks of a tensor-parallel group is cut, and joined again.

A parameter split along `dim` over `tp` ranks may be a concatenation of `blocks` equal blocks
(a fused q|k|v weight: 3 blocks): each rank's part is its slice of every block, in block order::

    whole, dim 0, blocks=3, tp=2:   [q0 q1 | k0 k1 | v0 v1]
    part 0: [q0 k0 v0]      part 1: [q1 k1 v1]

A cut parameter carries its `TpShard` (`shard_of`), so checkpoints save it under its own name with
its whole shape, and load a whole tensor into its part. Pure tensor arithmetic: no collectives.

A dimension of n rows that does not divide by tp (a vocabulary of 50257 words at tp=2) is cut
unevenly, in one block: each rank holds c = ceil(n / tp) rows but the last, which holds the rest,
as Megatron-LM's vocabulary padded to a multiple of tp would be held, less the padding::

    n = 67, tp = 2:   part 0: rows 0-33 (34)    part 1: rows 34-66 (33)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TpShard", "shard_of", "whole_shape", "as_held", "local_part", "whole_of", "part_rows", "part_size",
           "uneven_fits", "RowSpan", "row_span"]


@dataclass(frozen=True)
class TpShard:
    """How a parameter was cut: its whole shape, the dimension, blocks, and which part this is."""

    shape: tuple[int, ...]
    dim: int
    blocks: int
    tp_rank: int
    tp: int

    def part(self, whole: torch.Tensor) -> torch.Tensor:
        """This shard's part of the whole tensor."""
        return local_part(whole, self.dim, self.blocks, self.tp_rank, self.tp)


def shard_of(t: torch.Tensor) -> TpShard | None:
    """The cut of a tensor-parallel parameter, or None for a whole one."""
    return getattr(t, "_plait_tp", None)


def whole_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor `t` is a part of (its own shape when it is not cut)."""
    cut = shard_of(t)
    return cut.shape if cut is not None else tuple(t.shape)


def as_held(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as `t` holds it: this rank's part of a whole value when `t` is a cut tensor (a value
    of the part's shape, or of a tensor not cut, as it is)."""
    cut = shard_of(t)
    if cut is not None and tuple(value.shape) == cut.shape and cut.shape != tuple(t.shape):
        return cut.part(value)
    return value


def part_rows(n: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """[start, stop) of part `tp_rank` of n rows cut in one block (see the module)."""
    c = -(-n // tp)
    return min(tp_rank * c, n), min((tp_rank + 1) * c, n)


def part_size(n: int, tp_rank: int, tp: int) -> int:
    """The rows of part `tp_rank` of n rows cut in one block (n // tp where tp divides n)."""
    start, stop = part_rows(n, tp_rank, tp)
    return stop - start


def uneven_fits(n: int, tp: int) -> bool:
    """Whether n rows cut unevenly leave every rank at least one (50257 at tp=8: yes; 9 at tp=4:
    parts 3, 3, 3, 0, no)."""
    return part_size(n, tp - 1, tp) > 0


def local_part(t: torch.Tensor, dim: int, blocks: int, tp_rank: int, tp: int) -> torch.Tensor:
    """Part `tp_rank` of `t` along `dim`: its slice of each of the `blocks` blocks, in block order
    (in one block, a dimension that does not divide by tp is cut unevenly: see the module)."""
    n = t.shape[dim]
    if blocks == 1 and n % tp:
        start, stop = part_rows(n, tp_rank, tp)
        return t.narrow(dim, start, stop - start)
    parts = t.reshape(*t.shape[:dim], blocks, tp, n // (blocks * tp), *t.shape[dim + 1:])
    return parts.select(dim + 1, tp_rank).flatten(dim, dim + 1)


def whole_of(parts: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """The inverse of `local_part`: the tp parts (in rank order) joined."""
    if blocks == 1:
        return torch.cat(parts, dim)
    cut = [p.reshape(*p.shape[:dim], blocks, p.shape[dim] // blocks, *p.shape[dim + 1:]) for p in parts]
    return torch.stack(cut, dim + 1).flatten(dim, dim + 2)


@dataclass(frozen=True)
class RowSpan:
    """Rows of a held tensor (a zero=3 replica's rows of a parameter, of its tp part where tp cut
    it) as the rows [start, stop) of the whole tensor to read, and what the holder keeps of them."""

    start: int
    stop: int
    cut: TpShard | None = None  # the tp cut to take the read rows through (none: kept as read)
    rows: tuple[int, int] | None = None  # then these rows of the part (a cut of several blocks along dim 0)

    def kept(self, value: torch.Tensor) -> torch.Tensor:
        """What the holder keeps of `value`, the whole tensor's rows start:stop."""
        if self.cut is None:
            return value
        part = self.cut.part(value)
        return part if self.rows is None else part[self.rows[0]:self.rows[1]]


def row_span(t: torch.Tensor, start: int, stop: int) -> RowSpan:
    """Rows start:stop (dim 0) of `t` -- of its part, where tp cut it -- as rows of the whole tensor:
    the same rows (a cut along another dim: each part holds every row, cut after reading), the
    part's own rows shifted (one block along dim 0), or every row (several blocks along dim 0)."""
    cut = shard_of(t)
    if cut is None:
        return RowSpan(start, stop)
    if cut.dim != 0:
        return RowSpan(start, stop, cut)
    if cut.blocks == 1:
        first = part_rows(cut.shape[0], cut.tp_rank, cut.tp)[0]
        return RowSpan(first + start, first + stop)
    return RowSpan(0, cut.shape[0], cut, (start, stop))
