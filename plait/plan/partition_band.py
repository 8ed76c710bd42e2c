"""The exact partition of a long model: the partition's dynamic programs on the band of reachable cuts.

`partition._Tables` holds (n + 1) x (n + 1) tables of every range [start, end): 450 MB each for
a 7,500-layer GPT, and a pass over them per stage. Here a pass touches only the cuts a layout
can reach and the ranges a stage can hold, in O(stages x layers x window) time and O(layers)
memory per stage:

    stage s ends at i in [lo_s, hi_s]:  lo_s = max(s, the earliest end from which the last
                                        S - s stages can still reach n within t_max each),
                                        hi_s = min(n - (S - s), the furthest s stages reach)
    stage s starts at j = i - k, k = 1 .. window (the most layers a range within t_max, and
                                        within the memory limit, can hold)

       layer ->  0    1    2    3    4    5    6    7
    stage 1     [=========)                               ends in [lo_1, hi_1]
    stage 2               [====.=====)                    ends in [lo_2, hi_2]
    stage 3                         [====.=====)          ...

Each pair (j, i) is priced with the same float operations, from the same prefix sums, as the
dense tables, and ties go to the smallest start as there: within the band both give the same
values and the same layout. A 7,500-layer model of identical blocks on 2,500 stages has a band
a few cuts wide and a window of a few layers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from plait.errors import PartitionError

__all__ = ["BandedTables"]

Floats = npt.NDArray[np.float64]


def _prefix(values: Sequence[float], n: int) -> Floats:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values if len(values) else [0.0] * n,
                                                       dtype=np.float64))))


class BandedTables:
    """`partition._Tables`'s programs (`run`, `min_max_time`, `least_memory`) without its tables."""

    def __init__(self, problem: Any) -> None:  # a partition.PartitionProblem (which imports this module)
        p = self.p = problem
        n = self.n = len(problem.time)
        if not 1 <= problem.num_chunks <= n:
            raise PartitionError(
                f"cannot cut {n} layers into {problem.num_chunks} stages; use between 1 and {n}"
            )
        allowed = np.ones(n + 1, dtype=bool)  # a cut after layer k - 1, as `_cuts_allowed`
        for a, b in problem.uncuttable:
            allowed[a + 1: b + 1] = False
        self.allowed = allowed
        self.tp = _prefix(problem.time, n)
        self.tp_list = self.tp.tolist()
        self.fp = _prefix(problem.fill, n)
        self.lp = _prefix(problem.last_fill, n)
        self.fx = _prefix(problem.fixed, n)
        self.on = _prefix(problem.once, n)
        self.ph = _prefix(problem.per_held, n)
        self.entry = np.asarray(list(problem.entry or [0.0] * n) + [0.0], dtype=np.float64)
        self.cut = np.concatenate(([0.0], np.asarray(problem.cut_time, dtype=np.float64), [0.0]))
        # a lower bound on a range's memory at any stage: no entry bytes, the fewest held
        self.floor_memory = self.fx + self.on + min(problem.held) * self.ph
        # memory(j, i) = rise[i] - drop[j] at each distinct held count (prefix form)
        self._rise: dict[float, Floats] = {}
        self._drop: dict[float, Floats] = {}
        for held in set(problem.held):
            self._rise[held] = self.fx + self.on + held * self.ph
            self._drop[held] = self.fx + self.on + held * (self.ph - self.entry)
        self._least: float | None = None

    # -- bands and windows -----------------------------------------------------------------

    def _furthest(self, j: int, limit: float) -> int:
        """The largest i with tp[i] - tp[j] <= limit (the prefix is nondecreasing)."""
        tp = self.tp_list
        i = min(bisect.bisect_right(tp, tp[j] + limit), self.n + 1) - 1
        while i + 1 <= self.n and tp[i + 1] - tp[j] <= limit:
            i += 1
        while i > j and tp[i] - tp[j] > limit:
            i -= 1
        return i

    def _earliest(self, i: int, limit: float) -> int:
        """The smallest j with tp[i] - tp[j] <= limit."""
        tp = self.tp_list
        j = max(bisect.bisect_left(tp, tp[i] - limit), 0)
        while j > 0 and tp[i] - tp[j - 1] <= limit:
            j -= 1
        while j < i and tp[i] - tp[j] > limit:
            j += 1
        return j

    def _bands(self, t_max: float) -> list[tuple[int, int]] | None:
        """[lo_s, hi_s] of each stage's end (s = 0 .. S; stage 0 ends at 0), None if empty."""
        n, stages = self.n, self.p.num_chunks
        finite = math.isfinite(t_max)
        reach, back = [0], [n]
        for _ in range(stages):
            reach.append(self._furthest(reach[-1], t_max) if finite else n)
            back.append(self._earliest(back[-1], t_max) if finite else 0)
        back.reverse()
        bands = [(max(s, back[s]), min(n - (stages - s), reach[s])) for s in range(stages + 1)]
        return None if any(lo > hi for lo, hi in bands) else bands

    def _window(self, t_max: float, memory_limit: float) -> int:
        """The most layers one range may hold: its time <= t_max and memory <= memory_limit."""
        ends = np.arange(self.n + 1)
        widest = self.n
        if math.isfinite(t_max):  # tp[i] - tp[j] <= t_max: j >= the first start within reach
            starts = np.searchsorted(self.tp, self.tp - t_max * (1 + 1e-12) - 1e-300, side="left")
            widest = min(widest, int((ends - starts).max()) + 1)
        if math.isfinite(memory_limit):  # a range's memory is at least its floor
            g = self.floor_memory
            starts = np.searchsorted(g, g - memory_limit * (1 + 1e-12) - 1e-300, side="left")
            widest = min(widest, int((ends - starts).max()) + 1)
        return max(widest, 1)

    # -- per-range terms, as the dense tables compute them -----------------------------------

    def _shifted(self, a: int, b: int, k: int) -> tuple[slice, slice]:
        return slice(a, b + 1), slice(a - k, b - k + 1)

    def _memory(self, ends: slice, starts: slice, held: float) -> Floats:
        rise, drop = self._rise.get(held), self._drop.get(held)
        if rise is None or drop is None:
            rise = self.fx + self.on + held * self.ph
            drop = self.fx + self.on + held * (self.ph - self.entry)
        return np.asarray(rise[ends] - drop[starts], dtype=np.float64)

    def _sweep(self, t_max: float, memory_limit: float, score: str
               ) -> tuple[float, list[tuple[int, npt.NDArray[np.intp]]]] | None:
        """One program over the band: `score` "sum" (min fill + cut, every range within t_max
        and the memory limit) or "max" (min of the slowest range's time, within memory) or
        "memory" (min of the largest range's memory). Returns best[n] and each stage's choices."""
        p, n, stages = self.p, self.n, self.p.num_chunks
        bands = self._bands(t_max)
        if bands is None:
            return None
        window = self._window(t_max, memory_limit)
        inf = math.inf
        prev = np.full(n + 1, inf)
        prev[0] = 0.0
        choices: list[tuple[int, npt.NDArray[np.intp]]] = []
        for s in range(1, stages + 1):
            lo, hi = bands[s]
            plo, phi = bands[s - 1]
            held = p.held[s - 1]
            last = s == stages
            cur = np.full(n + 1, inf)
            choice = np.zeros(hi - lo + 1, dtype=np.intp)
            for k in range(min(window, hi - plo), 0, -1):  # starts ascending: ties keep the first
                a, b = max(lo, plo + k), min(hi, phi + k)
                if a > b:
                    continue
                ends, starts = self._shifted(a, b, k)
                ok = self.allowed[starts] & self.allowed[ends]
                if score == "memory":
                    value = np.maximum(prev[starts], self._memory(ends, starts, held))
                else:
                    ok &= self._memory(ends, starts, held) <= memory_limit
                    time = self.tp[ends] - self.tp[starts]
                    if score == "max":
                        value = np.maximum(prev[starts], time)
                    else:
                        ok &= time <= t_max
                        fill = self.fp[ends] - self.fp[starts]
                        if last:
                            fill = fill + (self.lp[ends] - self.lp[starts])
                        value = prev[starts] + fill + self.cut[starts]
                value = np.where(ok, value, inf)
                better = value < cur[ends]
                cur[ends] = np.where(better, value, cur[ends])
                choice[a - lo: b - lo + 1][better] = k  # layers of the stage: it starts at i - k
            choices.append((lo, choice))
            prev = cur
        return float(prev[n]), choices

    def walk(self, choices: list[tuple[int, npt.NDArray[np.intp]]]) -> list[int]:
        """Layers per stage of the layout the choices lead to from n back to 0."""
        sizes, i = [], self.n
        for lo, choice in reversed(choices):
            j = i - int(choice[i - lo])
            sizes.append(i - j)
            i = j
        return sizes[::-1]

    # -- the programs partition.optimal_partition needs --------------------------------------

    def run(self, t_max: float) -> tuple[float, list[int]] | None:
        """Min fill + cut sum with every stage time <= t_max, and its layout (None: none fits)."""
        found = self._sweep(t_max, self.p.memory_limit, "sum")
        if found is None or not math.isfinite(found[0]):
            return None
        return found[0], self.walk(found[1])

    def range_time(self, start: int, end: int) -> float:
        return float(self.tp[end] - self.tp[start])

    def min_max_time(self) -> float:
        """The smallest slowest-stage time of a layout that fits (inf: none fits). Tried within a
        bound, from a lower bound (the slowest layer, the mean stage) doubling: a program confined
        to those ranges is exact when its answer is within the bound (the optimum's are inside)."""
        n, stages = self.n, self.p.num_chunks
        bound = max(float(np.max(self.tp[1:] - self.tp[:-1])), float(self.tp[n]) / stages)
        total = float(self.tp[n])
        if max(self.alone()) > self.p.memory_limit:
            return math.inf  # a layer fits no stage
        while bound < total:  # each try costs about its bound: double it
            found = self._sweep(bound, self.p.memory_limit, "max")
            if found is not None and found[0] <= bound:
                return found[0]
            bound = 2 * bound if bound > 0 else total
        found = self._sweep(math.inf, self.p.memory_limit, "max")  # ranges within memory only
        return math.inf if found is None else found[0]

    def next_time(self, after: float) -> float | None:
        """The smallest range time tp[i] - tp[j] > `after` over every range (None: none)."""
        tp, n = self.tp, self.n
        starts = np.arange(n + 1)
        ends = np.minimum(np.searchsorted(tp, tp + after, side="right"), n)
        for _ in range(3):  # tp + after rounds: settle on the first end whose time exceeds
            earlier = np.maximum(ends - 1, starts)
            ends = np.where(tp[earlier] - tp > after, earlier, ends)
            later = np.minimum(ends + 1, n)
            ends = np.where(tp[ends] - tp > after, ends, later)
        times = tp[ends] - tp
        keep = (ends > starts) & (times > after)
        return float(times[keep].min()) if keep.any() else None

    def alone(self) -> list[float]:
        """Each layer's memory as a stage of its own, at the fewest held micro-batches."""
        n = self.n
        return [float(x) for x in self._memory(slice(1, n + 1), slice(0, n), min(self.p.held)).tolist()]

    def least_memory(self) -> float:
        """The smallest peak stage memory over all layouts (a min-max program)."""
        if self._least is None:
            self._least = self._least_memory()
        return self._least

    def _least_memory(self) -> float:
        stages, n = self.p.num_chunks, self.n
        even = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
        bound, start = 0.0, 0
        for s, size in enumerate(even):  # any layout bounds the optimum's largest range
            bound = max(bound, float(self._memory(slice(start + size, start + size + 1),
                                                  slice(start, start + 1), self.p.held[s])[0]))
            start += size
        found = self._sweep(math.inf, bound, "memory")
        if found is not None and found[0] <= bound:
            return found[0]
        found = self._sweep(math.inf, math.inf, "memory")  # the even split cut an uncuttable region
        return math.inf if found is None else found[0]
