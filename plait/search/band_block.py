"""A stage's block of candidate ranges in the banded partition: their own terms, each column's first minimum."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["RangeTerms", "own_terms", "first_minimum"]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.intp]


def first_minimum(value: Floats) -> tuple[Ints, Floats]:
    """Per column, the first row holding its minimum, and the minimum (numpy's argmin along
    rows copies the block column by column: for wide blocks the minimum, then the first row
    equal to it, is faster)."""
    rows, width = value.shape
    if rows > 3 and width < 128:
        row = np.asarray(value.argmin(axis=0), dtype=np.intp)
        return row, value[row, np.arange(width)]
    least = value.min(axis=0)
    if rows > 3:  # the highest weight (rows - r) among the rows equal to the minimum: the first
        weight = np.arange(rows, 0, -1, dtype=np.int16 if rows < 2**15 else np.int32)[:, None]
        return np.asarray(rows - ((value == least) * weight).max(axis=0), dtype=np.intp), least
    row = np.zeros(width, dtype=np.intp)
    seen = value[0] == least
    for r in range(1, rows):
        row += ~seen
        seen |= value[r] == least
    return row, least


def own_terms(terms: dict[str, npt.NDArray[Any]], score: str, held: float, last: bool) -> Floats:
    """A stage's own term per range for `score`, inf where the range may not be used: fill + cut
    ("sum"; the last stage's fill), its time ("max") or its memory ("memory")."""
    if score == "sum":
        own: Floats = np.add(terms["fill_last" if last else "fill"], terms["cut"], dtype=np.float64)
    else:
        own = np.array(terms["max" if score == "max" else f"memory{held}"], dtype=np.float64)
    np.copyto(own, math.inf, where=terms[f"bad{held}"])
    return own


class RangeTerms:
    """A program's per-range terms as (k x end) blocks, [row r, column c] the range of k = k_hi - r
    layers ending at i = c0 + c: "fill", "fill_last" (+ the last stage's), "cut" (paid at its
    start), "max" (its time), "memory" (per held count), and "bad{held}": the range may not be
    used (a cut not allowed; beyond t_max or the memory limit where the score bounds them)."""

    def __init__(self, tables: Any, t_max: float, memory_limit: float, score: str,
                 pad: int) -> None:  # a partition_band.BandedTables (which imports this module)
        self.t, self.t_max, self.memory_limit, self.score, self.pad = tables, t_max, memory_limit, score, pad

        def padded(values: npt.NDArray[Any], fill: Any) -> npt.NDArray[Any]:
            return np.concatenate((np.full(pad, fill, dtype=values.dtype), values))

        self.tp, self.fp, self.lp, self.cut = (padded(a, 0.0) for a in (tables.tp, tables.fp, tables.lp, tables.cut))
        self.allowed = padded(tables.allowed, False)
        self.drop = {held: padded(drop, 0.0) for held, drop in tables.drop.items()}
        if tables.pieces:
            self.fx, self.ph, self.pe = (padded(a, 0.0) for a in (tables.fx, tables.ph, tables.pe))
            self.entry, self.piece_once = padded(tables.entry, 0.0), padded(tables.piece_once, 0.0)

    def block(self, k_hi: int, k_lo: int, c0: int, c1: int, helds: set[float]
              ) -> dict[str, npt.NDArray[Any]]:
        """The terms of ranges of k_hi down to k_lo layers ending at c0 .. c1, at `helds`."""
        t, pad, width = self.t, self.pad, c1 - c0 + 1
        ends = slice(pad + c0, pad + c1 + 1)

        def at_start(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return sliding_window_view(values[pad + c0 - k_hi: pad + c1 - k_lo + 1], width)

        ok = at_start(self.allowed) & self.allowed[ends]
        out: dict[str, npt.NDArray[Any]] = {}
        if self.score != "memory":
            time = self.tp[ends] - at_start(self.tp)
            if self.score == "max":
                out["max"] = time
            else:
                ok &= time <= self.t_max
                out["fill"] = self.fp[ends] - at_start(self.fp)
                out["fill_last"] = out["fill"] + (self.lp[ends] - at_start(self.lp))
                out["cut"] = np.ascontiguousarray(at_start(self.cut))
        pieces = self._pieces(k_hi, k_lo, c0, c1, at_start) if t.pieces else None
        for held in helds:
            memory = t.rise[held][c0: c1 + 1] - at_start(self.drop[held])
            if pieces is not None:
                memory = np.minimum(memory, pieces[0] + held * pieces[1])
            if self.score == "memory":
                out[f"memory{held}"] = memory
                out[f"bad{held}"] = ~ok
            else:
                out[f"bad{held}"] = ~(ok & (memory <= self.memory_limit))
        return out

    def _pieces(self, k_hi: int, k_lo: int, c0: int, c1: int, at_start: Any
                ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """A block's memory recomputed piece by piece, as (held-free part, per held micro-batch):
        the fixed bytes and the largest piece, and the entries of the first layer and each piece."""
        pad, width = self.pad, c1 - c0 + 1
        ends = slice(pad + c0, pad + c1 + 1)
        largest, rows = np.zeros(width), []
        for k in range(1, k_hi + 1):  # the largest piece among the last k layers before each end
            largest = np.maximum(largest, self.piece_once[pad + c0 - k: pad + c1 - k + 1])
            if k >= k_lo:
                rows.append(largest)
        most = np.stack(rows[::-1])  # row 0: k_hi layers, as the other terms
        after_first = sliding_window_view(self.pe[pad + c0 - k_hi + 1: pad + c1 - k_lo + 2], width)
        return (self.fx[ends] - at_start(self.fx) + most,
                self.ph[ends] - at_start(self.ph) + at_start(self.entry) + self.pe[ends] - after_first)

