"""The partition's problem: the closed form of a pipeline's step time and each stage's memory, per cut."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from plait.cost.recompute_pieces import by_pieces
from plait.errors import PartitionError

__all__ = ["PartitionProblem", "cuts_allowed"]


def cuts_allowed(num_layers: int, uncuttable: Sequence[tuple[int, int]]) -> list[bool]:
    """allowed[k]: a boundary may fall after layer k (0 <= k < num_layers - 1)."""
    return [all(not (a <= k < b) for a, b in uncuttable) for k in range(num_layers - 1)]



@dataclass(frozen=True)
class PartitionProblem:
    """Cut n layers into `num_chunks` contiguous ranges minimising a pipeline's latency

        T = sum_s fill(s) + sum_cuts cut_time + bottleneck_count * max_s time(s)

    (Alpa §5, eq. 2: T = sum_i t_i + (B - 1) max_i t_i, with the fill term, the hand-overs at
    the cuts and the bottleneck count made per schedule by the cost model), subject to every
    stage's memory <= memory_limit:

        memory(s, layers j..i-1) = fixed[j:i] + once[j:i] + held[s] * (per_held[j:i] + entry[j])

    fixed: parameters, gradients, optimizer state; held[s]: micro-batches whose activations
    stage s holds at once under the schedule; per_held: activation bytes of one micro-batch;
    entry[j]: bytes of one micro-batch entering layer j (kept instead under recomputation,
    when `once` is the one micro-batch recomputed). Sums over a range are of per-layer values;
    `last_fill` is added to the fill of the last stage only. With `piece_once` and `piece_entry`
    (`plait.cost.recompute_pieces`) a recomputed stage may instead recompute piece by piece,
    and its memory is the lesser of the two:

        fixed[j:i] + max(piece_once[j:i]) + held[s] * (per_held[j:i] + entry[j] + piece_entry[j+1:i])
    """

    time: Sequence[float]
    fill: Sequence[float]
    cut_time: Sequence[float]  # n - 1: the objective's cost of a cut after layer k
    bottleneck_count: float
    num_chunks: int
    fixed: Sequence[float]
    per_held: Sequence[float]
    held: Sequence[float]  # one per stage
    memory_limit: float = math.inf
    once: Sequence[float] = ()  # () = zeros
    entry: Sequence[float] = ()  # () = zeros
    last_fill: Sequence[float] = ()  # () = zeros
    uncuttable: Sequence[tuple[int, int]] = ()
    names: Sequence[str] = ()  # for messages only
    piece_once: Sequence[float] = ()  # () = recomputed stages recompute whole
    piece_entry: Sequence[float] = ()

    def __post_init__(self) -> None:
        n = len(self.time)
        sizes = {"fill": len(self.fill), "fixed": len(self.fixed), "per_held": len(self.per_held)}
        sizes.update({k: len(v) for k, v in (("once", self.once), ("entry", self.entry),
                                             ("last_fill", self.last_fill), ("piece_once", self.piece_once),
                                             ("piece_entry", self.piece_entry)) if len(v)})
        wrong = {k: v for k, v in sizes.items() if v != n}
        if wrong or len(self.cut_time) != max(n - 1, 0) or len(self.held) != self.num_chunks:
            raise PartitionError(
                f"partition problem of {n} layers and {self.num_chunks} stages has arrays of "
                f"the wrong length ({wrong}, cut_time: {len(self.cut_time)}, held: "
                f"{len(self.held)}); give n per-layer values, n - 1 cut times, one held per stage"
            )

    def objective(self, layers_per_stage: Sequence[int]) -> float:
        """T of one layout (inf when a stage does not fit in memory)."""
        bounds = [0, *itertools.accumulate(layers_per_stage)]
        ends = bounds[1:-1]
        total = sum(self.cut_time[e - 1] for e in ends)
        worst = 0.0
        for s in range(len(layers_per_stage)):
            j, i = bounds[s], bounds[s + 1]
            if self.memory(s, j, i) > self.memory_limit:
                return math.inf
            total += sum(self.fill[j:i]) + (sum(self.last_fill[j:i]) if s == self.num_chunks - 1
                                            and self.last_fill else 0.0)
            worst = max(worst, sum(self.time[j:i]))
        return total + self.bottleneck_count * worst

    def memory(self, stage_index: int, start: int, end: int) -> float:
        """Bytes stage `stage_index` needs when it holds layers start..end-1 (recomputed piece by
        piece where that needs less)."""
        return min(self._whole(stage_index, start, end), self._by_pieces(stage_index, start, end))

    def by_pieces(self, stage_index: int, start: int, end: int) -> bool:
        """Whether that stage needs less recomputed piece by piece than whole."""
        return self._by_pieces(stage_index, start, end) < self._whole(stage_index, start, end)

    def _whole(self, stage_index: int, start: int, end: int) -> float:
        once = sum(self.once[start:end]) if self.once else 0.0
        entry = self.entry[start] if self.entry else 0.0
        return (sum(self.fixed[start:end]) + once
                + self.held[stage_index] * (sum(self.per_held[start:end]) + entry))

    def _by_pieces(self, stage_index: int, start: int, end: int) -> float:
        if not self.piece_once:
            return math.inf
        return by_pieces(self.fixed, self.per_held, self.entry, self.piece_once, self.piece_entry, start, end,
                         self.held[stage_index])
