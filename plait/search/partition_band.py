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

A stage's pass is one (window x band) block of numpy operations: row k, column i the range
[i - k, i), rows ordered by start; the ranges' own terms are built once per program.

Each pair (j, i) is priced with the same float operations, from the same prefix sums, as the
dense tables (a start's best + (fill + cut)), and ties go to the smallest start as there: within
the band both give the same values and the same layout. A 7,500-layer model of identical blocks
on 2,500 stages has a band a few cuts wide and a window of a few layers.

The band is narrowed by memory as by time: a range's memory is at least its floor (no entry
bytes, the fewest held micro-batches), a prefix difference. The min-max program is confined to
the ranges within a bound, the slowest stage of a layout that fits: a greedy fill bisected on
its stage time finds one near the least (else the least-memory layout, which fits exactly when
any layout does), so that program's band is as narrow as the partition's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from plait.errors import PartitionError
from plait.search.band_block import RangeTerms, first_minimum, own_terms

__all__ = ["BandedTables"]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.intp]
Choices = list[tuple[int, npt.NDArray[np.intp]]]  # per stage: its band's lo, the k chosen per end

_BLOCK = 1 << 20  # cells of one (rows x band) block of a stage's pass: bounds its temporaries
_WHOLE = 1 << 22  # up to this many (window x ends) cells a program's terms are built once


def _prefix(values: Sequence[float], n: int) -> Floats:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values if len(values) else [0.0] * n,
                                                       dtype=np.float64))))


class BandedTables:
    """`partition._Tables`'s programs (`run`, `min_max_time`, `least_memory`) without its tables."""

    def __init__(self, problem: Any) -> None:  # a partition.PartitionProblem (which imports this module)
        self.p = problem
        n = self.n = len(problem.time)
        if not 1 <= problem.num_chunks <= n:
            raise PartitionError(
                f"cannot cut {n} layers into {problem.num_chunks} stages; use between 1 and {n}"
            )
        allowed = np.ones(n + 1, dtype=bool)  # a cut after layer k - 1, as `cuts_allowed`
        for a, b in problem.uncuttable:
            allowed[a + 1: b + 1] = False
        self.allowed = allowed
        self.tp = _prefix(problem.time, n)
        self.fp = _prefix(problem.fill, n)
        self.lp = _prefix(problem.last_fill, n)
        self.fx = _prefix(problem.fixed, n)
        self.on = _prefix(problem.once, n)
        self.ph = _prefix(problem.per_held, n)
        self.entry = np.asarray(list(problem.entry or [0.0] * n) + [0.0], dtype=np.float64)
        self.cut = np.concatenate(([0.0], np.asarray(problem.cut_time, dtype=np.float64), [0.0]))
        # a lower bound on a range's memory at any stage: no entry bytes, the fewest held (and no
        # once-bytes where a stage may recompute piece by piece: one piece's, not their sum)
        self.pieces = bool(len(problem.piece_once))
        self.piece_once = np.asarray(problem.piece_once, dtype=np.float64)
        self.pe = _prefix(problem.piece_entry, n)
        self.floor_memory = self.fx + (0.0 if self.pieces else self.on) + min(problem.held) * self.ph
        # memory(j, i) = rise[i] - drop[j] at each distinct held count (prefix form)
        self.rise: dict[float, Floats] = {}
        self.drop: dict[float, Floats] = {}
        for held in set(problem.held):
            self.rise[held] = self.fx + self.on + held * self.ph
            self.drop[held] = self.fx + self.on + held * (self.ph - self.entry)
        # The floor bounds memory from below only for nonnegative bytes and counts; its reach
        # is widened by far more than the prefix sums' rounding (a few ulps of the largest).
        parts = (problem.fixed, problem.once, problem.per_held, problem.entry, problem.held,
                 problem.piece_once, problem.piece_entry)
        self._floor_memory_bounds = all(min(values, default=0.0) >= 0 for values in parts)
        self._memory_slack = 0.0
        if self._floor_memory_bounds:
            largest = max(float(np.max(np.abs(a))) for a in (*self.rise.values(), *self.drop.values()))
            self._memory_slack = 1e-9 * largest
        held_by_stage = np.asarray(problem.held, dtype=np.float64)
        self._stages_holding = {held: held_by_stage == held for held in self.rise}
        self._least: tuple[float, Choices] | None = None
        self._reach_cache: dict[float, list[int]] = {}
        last_cut = np.where(allowed, np.arange(n + 1), 0)
        self._cut_below = np.maximum.accumulate(last_cut).tolist()  # [i]: the last allowed cut <= i

    # -- bands and windows -----------------------------------------------------------------

    def _reaches(self, prefix: Floats, limit: float, slack: float) -> tuple[Ints, Ints]:
        """[j]: the furthest end from start j, [i]: the earliest start to end i, of a range whose
        prefix difference is within `limit` (widened by `slack`: a band may hold more, not less)."""
        n = self.n
        if not math.isfinite(limit):
            return np.full(n + 1, n), np.zeros(n + 1, dtype=np.intp)
        ahead = np.searchsorted(prefix, prefix + (limit + slack), side="right") - 1
        behind = np.searchsorted(prefix, prefix - (limit + slack), side="left")
        return ahead, behind

    def _bands(self, t_max: float, memory_limit: float) -> list[tuple[int, int]] | None:
        """[lo_s, hi_s] of each stage's end (s = 0 .. S; stage 0 ends at 0), None if empty."""
        n, stages = self.n, self.p.num_chunks
        ahead, behind = self._reaches(self.tp, t_max, 1e-12 * (abs(float(self.tp[n])) + t_max))
        if self._floor_memory_bounds and math.isfinite(memory_limit):
            more = self._reaches(self.floor_memory, memory_limit, 1e-9 * memory_limit + self._memory_slack)
            ahead, behind = np.minimum(ahead, more[0]), np.maximum(behind, more[1])
        forward, backward = ahead.tolist(), behind.tolist()
        reach, back = [0], [n]
        for _ in range(stages):
            reach.append(forward[reach[-1]])
            back.append(backward[back[-1]])
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

    # -- the program over the band ---------------------------------------------------------

    def _sweep(self, t_max: float, memory_limit: float, score: str) -> tuple[float, Choices] | None:
        """One program over the band: `score` "sum" (min fill + cut, every range within t_max
        and the memory limit) or "max" (min of the slowest range's time, within memory) or
        "memory" (min of the largest range's memory). Returns best[n] and each stage's choices.

        A stage's candidates are a (k x band) block: the range's own terms (`RangeTerms`, from
        arrays built once per program where they are small) and the previous stage's values
        at the range's start, a strided view of them (padded by `window` in front: a start
        below 0 reads inf). Rows run from the most layers down: starts ascend, and argmin
        keeps the first of equal values, as the dense tables do."""
        p, n, stages = self.p, self.n, self.p.num_chunks
        bands = self._bands(t_max, memory_limit)
        if bands is None:
            return None
        window = self._window(t_max, memory_limit)
        inf = math.inf
        terms = RangeTerms(self, t_max, memory_limit, score, window)
        whole = terms.block(window, 1, 0, n, set(p.held)) if window * (n + 1) <= _WHOLE else None
        combined: dict[tuple[float, bool], Floats] = {}  # a whole program's own terms, per held and last
        prev, cur = np.full(n + 1 + window, inf), np.full(n + 1 + window, inf)  # two rows, in turn
        prev[window] = 0.0
        choices: Choices = []
        for s in range(1, stages + 1):
            lo, hi = bands[s]
            held, last = p.held[s - 1], s == stages
            width = hi - lo + 1
            best: Floats | None = None
            choice = None  # layers of the stage ending at i: it starts at i - k
            k_hi = min(window, hi - bands[s - 1][0])  # the most layers from a start in the band
            rows = window if whole is not None else max(1, _BLOCK // width)
            if whole is not None and (held, last) not in combined:
                combined[held, last] = own_terms(whole, score, held, last)
            while k_hi >= 1:  # blocks of rows k_hi .. k_lo: starts ascending
                k_lo = max(1, k_hi - rows + 1)
                if whole is not None:
                    own = combined[held, last][window - k_hi:, lo: hi + 1]
                else:
                    own = own_terms(terms.block(k_hi, k_lo, lo, hi, {held}), score, held, last)
                start = np.ndarray((k_hi - k_lo + 1, width), np.float64, prev,
                                   8 * (window + lo - k_hi), (8, 8))  # prev at each range's start
                value = start + own if score == "sum" else np.maximum(start, own)
                row, lowest = first_minimum(value)
                if best is None or choice is None:
                    best, choice = lowest, np.asarray(k_hi - row, dtype=np.intp)
                else:  # a later block holds later starts: equal values keep the earlier
                    better = lowest < best
                    best = np.where(better, lowest, best)
                    choice = np.where(better, k_hi - row, choice)
                k_hi = k_lo - 1
            if best is not None:
                cur[window + lo: window + hi + 1] = best
            prev_lo, prev_hi = bands[s - 1]
            prev[window + prev_lo: window + prev_hi + 1] = inf  # all inf again: the next stage's
            prev, cur = cur, prev
            choices.append((lo, choice if choice is not None else np.zeros(width, dtype=np.intp)))
        return float(prev[window + n]), choices

    def walk(self, choices: Choices) -> list[int]:
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

    def slowest(self, sizes: Sequence[int]) -> float:
        """The slowest stage's time of a layout (layers per stage)."""
        ends = np.cumsum(np.asarray(sizes, dtype=np.intp))
        return float(np.max(self.tp[ends] - self.tp[ends - np.asarray(sizes, dtype=np.intp)]))

    def min_max_time(self) -> float:
        """The smallest slowest-stage time of a layout that fits (inf: none fits).

        A program confined to the ranges within a bound is exact when its answer is within the
        bound, and the slowest stage of any layout that fits is such a bound (the optimum's
        ranges are all inside). The bound is the greedy's (`_greedy_bound`), or else the
        least-memory layout's (which fits exactly when any layout does). A layer too large
        alone may still fit in a longer stage, which enters at an earlier layer (`entry`)."""
        bound = self._greedy_bound()
        if bound is None:
            if self.least_memory() > self.p.memory_limit:
                return math.inf
            bound = self.slowest(self.least_memory_layout())
        found = self._sweep(bound, self.p.memory_limit, "max")
        if found is None or found[0] > bound:  # not expected: the layout itself is inside
            found = self._sweep(math.inf, self.p.memory_limit, "max")
        return math.inf if found is None else found[0]

    def _greedy(self, t_max: float) -> list[int] | None:
        """A layout taking for each stage in turn the most layers within t_max and the memory
        limit (leaving one for each later stage), or None where that does not end at n. Not
        always one that fits where one does (a later start can need more memory: `entry`)."""
        n, stages, limit = self.n, self.p.num_chunks, self.p.memory_limit
        tp = self.tp
        reach = np.searchsorted(tp, tp + t_max * (1 - 1e-12), side="right") - 1
        within = {held: self._memory_reach(held, limit) for held in set(self.p.held)}
        ahead = [within[h] for h in self.p.held]
        step = reach.tolist()
        cut_below = self._cut_below
        sizes, j = [], 0
        for s in range(stages):
            i = cut_below[max(min(step[j], ahead[s][j], n - (stages - 1 - s)), 0)]
            if i <= j:
                return None
            sizes.append(i - j)
            j = i
        if j != n or not self.memory_fits(sizes, limit):
            return None
        return sizes

    def _memory_reach(self, held: float, limit: float) -> list[int]:
        """[j]: the furthest end a stage holding `held` micro-batches may reach from start j
        within `limit`, a little short of it (rounding); the greedy checks what it builds."""
        if held not in self._reach_cache:
            rise, drop = self.rise[held], self.drop[held]
            if not self._floor_memory_bounds or not math.isfinite(limit):
                reach = np.full(self.n + 1, self.n)
            else:
                reach = np.searchsorted(rise, drop + limit * (1 - 1e-12), side="right") - 1
            self._reach_cache[held] = reach.tolist()
        return self._reach_cache[held]

    def _greedy_bound(self) -> float | None:
        """The slowest stage of a layout that fits, near the least: the greedy bisected on its
        stage time, from a lower bound (the slowest layer, the mean stage) to where it fits."""
        sizes = self._greedy(math.inf)
        if sizes is None:
            return None
        high = self.slowest(sizes)
        low = max(float(np.max(self.tp[1:] - self.tp[:-1])), float(self.tp[-1]) / self.p.num_chunks)
        for _ in range(40):
            if high <= low * (1 + 1e-5):  # the program's band: a few cuts wider than at the least
                break
            mid = (low + high) / 2
            sizes = self._greedy(mid)
            if sizes is None:
                low = mid
            else:
                high = min(high, self.slowest(sizes))
        return high

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
        n, held = self.n, min(self.p.held)
        return [float(x) for x in (self.rise[held][1:] - self.drop[held][:n]).tolist()]

    def memory_fits(self, sizes: Sequence[int], memory_limit: float) -> bool:
        """Whether every stage of a layout is within `memory_limit`, priced as the programs do."""
        ends = np.cumsum(np.asarray(sizes, dtype=np.intp))
        starts = ends - np.asarray(sizes, dtype=np.intp)
        for held, at in self._stages_holding.items():
            need = self.rise[held][ends[at]] - self.drop[held][starts[at]]
            if self.pieces:
                need = np.minimum(need, [self.by_pieces(held, int(j), int(i)) for j, i in zip(starts[at], ends[at])])
            if np.any(need > memory_limit):
                return False
        return bool(np.all(self.allowed[starts]) and np.all(self.allowed[ends]))

    def by_pieces(self, held: float, start: int, end: int) -> float:
        """A range's memory recomputed piece by piece (`PartitionProblem`), from the prefix sums."""
        return float(self.fx[end] - self.fx[start] + self.piece_once[start:end].max()
                     + held * (self.ph[end] - self.ph[start] + self.entry[start] + self.pe[end] - self.pe[start + 1]))

    def least_memory(self) -> float:
        """The smallest peak stage memory over all layouts (a min-max program)."""
        return self._least_memory()[0]

    def least_memory_layout(self) -> list[int]:
        """A layout whose largest stage needs `least_memory` (only when that is finite)."""
        return self.walk(self._least_memory()[1])

    def _least_memory(self) -> tuple[float, Choices]:
        if self._least is None:
            stages, n = self.p.num_chunks, self.n
            even = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
            bound, start = 0.0, 0
            for s, size in enumerate(even):  # any layout bounds the optimum's largest range
                held = self.p.held[s]
                bound = max(bound, float(self.rise[held][start + size] - self.drop[held][start]))
                start += size
            found = self._sweep(math.inf, bound, "memory")
            if found is None or found[0] > bound:  # the even split cut an uncuttable region
                found = self._sweep(math.inf, math.inf, "memory")
            self._least = (math.inf, []) if found is None else found
        return self._least
