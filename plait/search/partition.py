"""Choosing contiguous layer ranges per stage (balanced, or optimal for a step time), and checking a user's choice."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import numpy.typing as npt

from plait.cost.problem import PartitionProblem, cuts_allowed
from plait.cost.recompute_pieces import after_first, range_max
from plait.errors import PartitionError
from plait.search.partition_band import BandedTables

__all__ = [
    "balance",
    "check_partition",
    "PartitionResult",
    "Infeasible",
    "optimal_partition",
    "solve_partition",
    "least_memory",
    "brute_force_partition",
]


def balance(
    costs: Sequence[float], num_chunks: int, uncuttable: Sequence[tuple[int, int]] = ()
) -> list[int]:
    """Layers per stage minimising the most expensive stage (contiguous, each stage >= 1 layer).

    An exact dynamic program over cut positions: best[s][i] = the smallest possible maximum stage
    cost when the first i layers form s stages. O(num_chunks * n^2), n = len(costs).
    """
    n = len(costs)
    allowed = cuts_allowed(n, uncuttable)
    if num_chunks > n or num_chunks < 1:
        raise PartitionError(
            f"cannot cut {n} layers into {num_chunks} stages; use between 1 and {n} stages"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_chunks + 1)]
    choice = [[0] * (n + 1) for _ in range(num_chunks + 1)]
    best[0][0] = 0.0
    for s in range(1, num_chunks + 1):
        for i in range(s, n + 1):
            if i < n and not allowed[i - 1]:
                continue  # a stage may not end after layer i-1
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    if best[num_chunks][n] == inf:
        raise PartitionError(
            f"no way to cut {n} layers into {num_chunks} stages without splitting an uncuttable "
            f"region {list(uncuttable)}; use fewer stages"
        )
    sizes = []
    i = n
    for s in range(num_chunks, 0, -1):
        j = choice[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def check_partition(
    layers_per_stage: Sequence[int],
    layer_names: Sequence[str],
    uncuttable: Sequence[tuple[int, int]] = (),
) -> None:
    """Raise PartitionError naming the layers if `layers_per_stage` does not fit the model."""
    n = len(layer_names)
    listing = ", ".join(f"{i}:{name}" for i, name in enumerate(layer_names))
    if len(layers_per_stage) > n:
        raise PartitionError(
            f"{len(layers_per_stage)} stages but the model has only {n} layers ({listing}); "
            f"use at most {n} stages"
        )
    if sum(layers_per_stage) != n:
        raise PartitionError(
            f"layers_per_stage={list(layers_per_stage)} sums to {sum(layers_per_stage)} but the "
            f"model has {n} layers: {listing}. Give counts that sum to {n}, or "
            "layers_per_stage=None to balance automatically"
        )
    end = -1
    for size in layers_per_stage[:-1]:
        end += size
        for a, b in uncuttable:
            if a <= end < b:
                region = ", ".join(layer_names[a : b + 1])
                raise PartitionError(
                    f"layers_per_stage={list(layers_per_stage)} cuts after layer {end} "
                    f"({layer_names[end]}), inside an uncuttable region: layers {a}..{b} "
                    f"({region}) reuse a module and must stay on one stage. Move the cut before "
                    f"layer {a} or after layer {b}"
                )


# -- the exact partition for a pipeline's step time ---------------------------------------------


@dataclass(frozen=True)
class PartitionResult:
    """The optimal layout, its objective T and its slowest stage's time."""

    layers_per_stage: tuple[int, ...]
    objective: float
    max_time: float


DENSE_LAYERS = 256  # up to this many layers the (n + 1) x (n + 1) tables; beyond, `partition_band`


@dataclass(frozen=True)
class Infeasible:
    """Why no layout of a problem fits, and the least peak stage memory any layout needs (inf:
    no layout at all), which a search reports beside the reason."""

    reason: str
    least_memory: float


def optimal_partition(problem: PartitionProblem) -> PartitionResult:
    """The layout minimising `problem`'s T exactly, or PartitionError saying what does not fit.

    For each candidate bound t_max on the slowest stage -- every contiguous range's time, in
    increasing order -- a dynamic program finds the smallest fill + cut sum with every stage
    <= t_max and within memory; T(t_max) = that sum + count * (the layout's own max). The
    optimum's own max is one of the candidates, so the best T over all of them is exact. As in
    Alpa, the scan starts at the smallest feasible t_max (a min-max program) and stops once
    (min sum without bound) + count * t_max can no longer beat the best T found.
    """
    found = solve_partition(problem)
    if isinstance(found, Infeasible):
        raise PartitionError(found.reason)
    return found


def solve_partition(problem: PartitionProblem) -> PartitionResult | Infeasible:
    """`optimal_partition`'s layout, or (no layout fits) its reason with the least memory."""
    if len(problem.time) > DENSE_LAYERS:
        return _banded_partition(problem)
    tables = _Tables(problem)
    unbounded = tables.run(math.inf)
    if unbounded is None:
        return Infeasible(tables.why_infeasible(), tables.least_memory())
    if problem.bottleneck_count <= 0:
        return unbounded
    lowest = tables.min_max_time()
    best = unbounded
    floor = unbounded.objective - problem.bottleneck_count * unbounded.max_time  # min fill sum
    for t_max in tables.time_candidates(lowest):
        if floor + problem.bottleneck_count * t_max >= best.objective:
            break
        found = tables.run(t_max)
        if found is not None and found.objective < best.objective:
            best = found
    return best


def _banded_partition(problem: PartitionProblem) -> PartitionResult | Infeasible:
    """`optimal_partition` on `BandedTables`: the same scan over t_max, without the tables. The
    unbounded layout is not computed: its T is floor + count x its max, which the scan reaches
    or stops below (the stop uses a lower bound on the floor: every fill, the cheapest cuts).
    A stretch of t_max that cannot beat the best T is passed with one program (`_pass_over`):
    the same layout as stepping through it, in a few programs instead of one per range time."""
    tables = BandedTables(problem)
    count = problem.bottleneck_count

    def result(found: tuple[float, list[int]]) -> PartitionResult:
        value, sizes = found
        worst = tables.slowest(sizes)
        return PartitionResult(tuple(sizes), value + count * worst, worst)

    lowest = tables.min_max_time() if count > 0 else math.inf
    found = tables.run(lowest) if math.isfinite(lowest) or count <= 0 else None
    if found is None:
        reason = why_infeasible(problem, tables.alone(), tables.least_memory)
        return Infeasible(reason, tables.least_memory())
    best = result(found)
    if count <= 0:
        return best
    cuts = np.sort(tables.cut[1:-1][tables.allowed[1:-1]])[: problem.num_chunks - 1]
    floor = float(tables.fp[-1]) * (1 - 1e-9) + float(cuts.sum()) * (1 - 1e-9)
    t = tables.next_time(lowest)
    wait, steps = 0, 0  # after a pass fails, the next is tried 1, 2, 4, ... steps later
    while t is not None and floor + count * t < best.objective:
        if steps >= wait:
            passed = _pass_over(tables, t, (best.objective - floor) / count, count * t, best.objective)
            if passed is not None:  # no t_max in [t, passed] gives a better T: go on after it
                t, wait, steps = tables.next_time(passed), 0, 0
                continue
            wait, steps = max(1, 2 * wait), 0
        found = tables.run(t)
        steps += 1
        if found is not None:
            candidate = result(found)
            if candidate.objective < best.objective:
                best = candidate
        t = tables.next_time(t)
    return best


def _pass_over(tables: BandedTables, t: float, stop: float, bottleneck: float, best: float
               ) -> float | None:
    """The end of a stretch [t, end] of the scan whose t_max cannot beat `best`, or None.

    The scan's next T(t_max) for t_max in [t, end] is its sum + count x its layout's max. The
    sum is at least sum(end) (a looser bound, more layouts), and a layout whose max is below t
    was a candidate already at its own max with the same sum: only those with max >= t are
    new, so T >= sum(end) + count x t (`bottleneck`); where that is >= `best`, the stretch is
    passed with one program. Many range times differ only by rounding (blocks of one cost in
    other places): one program passes them all instead of one each. Tried up to `stop`, where
    the scan ends."""
    if stop <= t:
        return None
    found = tables.run(stop)
    return stop if found is not None and found[0] + bottleneck >= best else None


class _Tables:
    """Range sums and feasibility masks of a problem, as (n + 1) x (n + 1) arrays [start, end)."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.p = problem
        self._least: float | None = None
        n = self.n = len(problem.time)
        if not 1 <= problem.num_chunks <= n:
            raise PartitionError(
                f"cannot cut {n} layers into {problem.num_chunks} stages; use between 1 and {n}"
            )
        allowed = [True] + cuts_allowed(n, problem.uncuttable) + [True]  # boundary k: after layer k-1
        start = np.arange(n + 1)[:, None]
        end = np.arange(n + 1)[None, :]
        ok_bounds = np.array(allowed, dtype=bool)
        self.valid = (start < end) & ok_bounds[:, None] & ok_bounds[None, :]

        def ranges(values: Sequence[float]) -> npt.NDArray[np.float64]:
            prefix = np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))
            return np.asarray(prefix[None, :] - prefix[:, None], dtype=np.float64)

        zeros = [0.0] * n
        self.time = ranges(problem.time)
        self.fill = ranges(problem.fill)
        self.last_fill = ranges(problem.last_fill or zeros)
        cuts = np.concatenate(([0.0], np.asarray(problem.cut_time, dtype=np.float64), [0.0]))
        self.cut = cuts[:, None]  # paid by a stage starting after a cut
        base = ranges(problem.fixed) + ranges(problem.once or zeros)
        entry = np.asarray(list(problem.entry or zeros) + [0.0], dtype=np.float64)
        per = ranges(problem.per_held) + entry[:, None]
        self.base, self.per = base, per
        self.pieces: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None
        if problem.piece_once:  # recomputed piece by piece: max of the pieces, their entries held
            self.pieces = (ranges(problem.fixed) + range_max(problem.piece_once),
                           ranges(problem.per_held) + entry[:, None] + after_first(problem.piece_entry))
        masks: dict[float, npt.NDArray[np.bool_]] = {}
        self.fits = []
        for h in problem.held:
            if h not in masks:
                masks[h] = self.valid & (self.need(h) <= problem.memory_limit)
            self.fits.append(masks[h])

    def need(self, held: float) -> npt.NDArray[np.float64]:
        """[start, end]: the range's memory as a stage holding `held` micro-batches."""
        need = self.base + held * self.per
        if self.pieces is not None:
            need = np.minimum(need, self.pieces[0] + held * self.pieces[1])
        return need

    def run(self, t_max: float) -> PartitionResult | None:
        """Min fill + cut sum with every stage time <= t_max (None: no layout fits)."""
        p, n = self.p, self.n
        inf = math.inf
        best = np.full(n + 1, inf)
        best[0] = 0.0
        choices = []
        columns = np.arange(n + 1)
        bounded = self.time <= t_max
        for s in range(p.num_chunks):
            fill = self.fill + self.last_fill if s == p.num_chunks - 1 else self.fill
            cand = np.where(self.fits[s] & bounded, best[:, None] + (fill + self.cut), inf)
            arg = cand.argmin(axis=0)
            best = cand[arg, columns]
            choices.append(arg)
        if not math.isfinite(best[n]):
            return None
        sizes = self._walk(choices)
        worst = max(float(self.time[a, b]) for a, b in _ranges(sizes))
        return PartitionResult(tuple(sizes), float(best[n]) + p.bottleneck_count * worst, worst)

    def min_max_time(self) -> float:
        """The smallest possible slowest-stage time of a layout that fits (balance with memory)."""
        best = np.full(self.n + 1, math.inf)
        best[0] = 0.0
        for s in range(self.p.num_chunks):
            cand = np.where(self.fits[s], np.maximum(best[:, None], self.time), math.inf)
            best = cand.min(axis=0)
        return float(best[self.n])

    def time_candidates(self, lowest: float) -> list[float]:
        """Distinct range times >= `lowest` of ranges that fit somewhere, ascending."""
        fits_any = np.logical_or.reduce(self.fits)
        values = np.unique(self.time[fits_any])
        return [float(v) for v in values if v >= lowest]

    def _walk(self, choices: list[npt.NDArray[np.intp]]) -> list[int]:
        sizes, i = [], self.n
        for s in range(self.p.num_chunks - 1, -1, -1):
            j = int(choices[s][i])
            sizes.append(i - j)
            i = j
        return sizes[::-1]

    def least_memory(self) -> float:
        """The smallest achievable peak memory over all layouts (a min-max program; once: an
        infeasible problem's reason and its `Infeasible` both ask)."""
        if self._least is None:
            best = np.full(self.n + 1, math.inf)
            best[0] = 0.0
            for s in range(self.p.num_chunks):
                need = np.where(self.valid, self.need(self.p.held[s]), math.inf)
                best = np.maximum(best[:, None], need).min(axis=0)
            self._least = float(best[self.n])
        return self._least

    def why_infeasible(self) -> str:
        """Which layer or which stage count does not fit, with the numbers."""
        need = self.need(min(self.p.held))
        alone = [float(need[j, j + 1]) for j in range(self.n)]
        return why_infeasible(self.p, alone, self.least_memory)


def why_infeasible(problem: PartitionProblem, alone: Sequence[float], least: Callable[[], float]) -> str:
    """Which layer or which stage count of `problem` does not fit, with the numbers. `alone`:
    each layer's memory as a stage of its own at the fewest held micro-batches; `least`: the
    smallest peak memory of any layout (called only when every layer fits alone)."""
    p, n = problem, len(problem.time)
    gib = 2.0**30
    held = min(p.held)  # the most favourable stage
    need, layer = max((need, j) for j, need in enumerate(alone))
    if need > p.memory_limit:
        name = f" ({p.names[layer]})" if p.names else ""
        return (
            f"layer {layer}{name} alone needs {need / gib:.2f} GiB (parameters, gradients, "
            f"optimizer state and {held:g} micro-batches of activations) but a device has "
            f"{p.memory_limit / gib:.2f} GiB: needs tensor parallelism (or sharded optimizer "
            f"state), recomputation or smaller micro-batches"
        )
    lowest = least()
    if math.isinf(lowest):
        return (f"no way to cut {n} layers into {p.num_chunks} stages without splitting an "
                f"uncuttable region {list(p.uncuttable)}; use fewer stages")
    return (
        f"every split of {n} layers into {p.num_chunks} stages needs at least "
        f"{lowest / gib:.2f} GiB on some device, more than its {p.memory_limit / gib:.2f} GiB: "
        f"use more pipeline stages, recomputation or smaller micro-batches, or tensor "
        f"parallelism"
    )


def least_memory(problem: PartitionProblem) -> float:
    """The smallest peak stage memory any layout of `problem` needs (inf: no layout at all)."""
    if len(problem.time) > DENSE_LAYERS:
        return BandedTables(problem).least_memory()
    return _Tables(problem).least_memory()


def _ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds = [0, *itertools.accumulate(sizes)]
    return list(zip(bounds[:-1], bounds[1:]))


def brute_force_partition(problem: PartitionProblem) -> PartitionResult | None:
    """Every composition of n into num_chunks parts, for tests and tiny models: the optimum."""
    n, stages = len(problem.time), problem.num_chunks
    best: PartitionResult | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        if any(a <= c - 1 < b for c in cuts for a, b in problem.uncuttable):
            continue
        sizes = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        value = problem.objective(sizes)
        if math.isfinite(value) and (best is None or value < best.objective):
            worst = max(sum(problem.time[a:b]) for a, b in _ranges(sizes))
            best = PartitionResult(sizes, value, worst)
    return best
