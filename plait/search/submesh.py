"""Alpa's inter-operator pass: the stages of one pipeline and the tp width of each, by a dynamic program.

Alpa (Zheng et al. 2022, section 5) cuts the layers into stages and gives each stage a sub-mesh
of its own shape, minimising the pipeline's latency

    T = sum_s t_s + (m - 1) max_s t_s

over (layer range, sub-mesh) pairs whose costs come from the intra-operator pass. Here a stage's
sub-mesh is its tp width (the runtime's intra-stage parallelism), each width's per-layer costs are
the tp pass's (`plait.cost.tp_costs.at_tp`), and the widths of all stages add up to the devices of
one pipeline. For each candidate bottleneck t_max (every stage time a (range, width) pair can
have, in increasing order) a table over (stages left, first layer, devices left) keeps the least
sum of fills and hand-overs whose stages all take <= t_max and fit in memory; the best
(m - 1) t_max + that sum over the candidates is the optimum (the optimum's own bottleneck is
among them). The enumeration starts at the first t_max whose stages can cover the layers on the
devices (bisection) and stops once (m - 1) t_max plus the sum without any bound on the
bottleneck (a floor under all of them) cannot beat the best found (Alpa's early stop). Beyond 64
candidates they are tried in buckets 1% wide, each at its top, and every layout found is priced
at its own bottleneck: T is then within 1% of the optimum's (a GPT of 48 layers on 16 devices
has thousands of candidates). A problem whose parameters and their state alone outgrow the
devices is refused before any table, and a table's stage ends run over the stage lengths that
fit, not over every layer (Alpa's GPT-39B on 64 V100s: 26.8 s of CPU for `plait plan`, 6.6 s after). Memory of a stage j-th from the end: its fixed bytes plus the
micro-batches it holds (1F1B: min(j, m); GPipe: m) times its activations of one; recomputed, its
input of each held micro-batch (`entry` at its first layer) and one micro-batch's activations
(`once`, while it is recomputed) -- or, where given its pieces and less, recomputed layer by layer
(`plait.cost.recompute_pieces`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from plait.cost.recompute_pieces import after_first, by_pieces, range_max
from plait.errors import PartitionError

__all__ = ["WidthCosts", "WidthLayout", "width_partition", "pipeline_floor"]

EXACT, THIN = 64, 0.01  # more bottleneck candidates than EXACT: tried in buckets 1% wide


@dataclass(frozen=True)
class WidthCosts:
    """One width's per-layer costs on each of its ranks: bottleneck time, fill time (both per
    micro-batch), fixed bytes (parameters, gradients, optimizer state) and activation bytes of
    one micro-batch."""

    time: Sequence[float]
    fill: Sequence[float]
    fixed: Sequence[float]
    activation: Sequence[float]
    once: Sequence[float] = ()  # () = zeros: bytes held once per stage (recomputation's one micro-batch)
    entry: Sequence[float] = ()  # () = zeros: bytes per held micro-batch of a stage starting here
    piece_once: Sequence[float] = ()  # recomputed piece by piece (`plait.cost.recompute_pieces`); () = never
    piece_entry: Sequence[float] = ()

    def memory(self, start: int, end: int, held: int) -> float:
        """Bytes of a stage of layers start..end-1 holding `held` micro-batches (recomputed piece by
        piece where that needs less)."""
        once = sum(self.once[start:end]) if self.once else 0.0
        entry = self.entry[start] if self.entry else 0.0
        whole = sum(self.fixed[start:end]) + once + held * (sum(self.activation[start:end]) + entry)
        if not self.piece_once:
            return whole
        return min(whole, by_pieces(self.fixed, self.activation, self.entry, self.piece_once, self.piece_entry,
                                    start, end, held))


@dataclass(frozen=True)
class WidthLayout:
    """The stages found: layers and tp width of each, and the objective T."""

    layers_per_stage: tuple[int, ...]
    widths: tuple[int, ...]
    objective: float


def width_partition(costs: Mapping[int, WidthCosts], cut_time: Sequence[float], devices: int,
                    num_microbatches: int, gpipe: bool = False, memory_limit: float = math.inf,
                    max_stages: int | None = None,
                    cross: Mapping[tuple[int, int], Sequence[float]] | None = None) -> WidthLayout:
    """The stages (layers, width) of one pipeline on exactly `devices` ranks minimising T plus
    the hand-overs after layer k, both ways: `cross[(a, b)][k]` from a stage of width a to one of
    width b, `cut_time[k]` for the pairs `cross` does not list. PartitionError when none fits."""
    widths = sorted(costs)
    n = len(next(iter(costs.values())).time) if costs else 0
    if not widths or n == 0 or devices < 1 or any(w < 1 for w in widths):
        raise PartitionError(f"width_partition needs widths >= 1 and layers, got widths {widths}, "
                             f"{n} layers, {devices} devices")
    if (len(cut_time) != n - 1 or any(len(c.time) != n for c in costs.values())
            or any(len(c) != n - 1 for c in (cross or {}).values())):
        raise PartitionError(f"width_partition: every width needs {n} per-layer values and {n - 1} cut times")
    m = num_microbatches
    least = _least_fixed_bytes(costs, n)
    if least > devices * memory_limit:  # no table needed: not even the parameters and their state fit
        raise PartitionError(
            f"no cut of {n} layers into stages of widths {widths} on {devices} devices fits {memory_limit:.3g} "
            f"bytes per device: their parameters, gradients and optimizer state alone need {least:.3g} bytes "
            f"over the devices at the least, {least / devices:.3g} per device; allow more devices")
    stages_cap = min(n, devices // widths[0], max_stages or n)
    time = {w: _range_sums(costs[w].time) for w in widths}  # [k, i]: layers k..i-1
    fill = {w: _range_sums(costs[w].fill) for w in widths}
    # memory [k, i] = fixed + once (range sums) + held x (activations + the entry at layer k)
    fixed = {w: _range_sums(costs[w].fixed) + (_range_sums(costs[w].once) if costs[w].once else 0.0)
             for w in widths}
    act = {w: _range_sums(costs[w].activation) + (_entry_column(costs[w].entry) if costs[w].entry else 0.0)
           for w in widths}
    pieces = {w: _piece_tables(costs[w]) for w in widths if costs[w].piece_once}
    hand = _hand_overs(widths, cut_time, cross or {}, n)
    tables = _Tables(widths, time, fill, fixed, act, hand, n, devices, m, gpipe, memory_limit, stages_cap, pieces)
    best: tuple[float, WidthLayout | None] = (math.inf, None)
    unbounded = tables.best_under(math.inf)
    # with no bound on the bottleneck the fills are least: a floor under every t_max's
    floor = unbounded[0] if unbounded is not None else math.inf
    candidates = np.unique(np.concatenate([t[np.isfinite(t)] for t in time.values()])).tolist()
    # fewest devices that cover the layers with stages <= t_max: falls as t_max grows, so the
    # first t_max worth a table is found by bisection (a necessary condition only); none is
    # tried where no layout fits at all
    low, high = 0, len(candidates) if unbounded is not None and m > 1 else 0
    while low < high:
        mid = (low + high) // 2
        if _fewest_devices(candidates[mid], widths, time, n) <= devices:
            high = mid
        else:
            low = mid + 1
    for t_max in _thinned(candidates[low:]) if unbounded is not None and m > 1 else ():
        if (m - 1) * t_max + floor >= best[0]:
            break  # every later bottleneck costs more than the best found
        found = tables.best_under(t_max)
        if found is not None:  # its own bottleneck may lie below t_max (a thinned bucket's top)
            value = found[0] + (m - 1) * tables.bottleneck(found[1])
            if value < best[0]:
                best = (value, found[1])
    if unbounded is not None and m == 1:  # one micro-batch: no bottleneck term
        best = unbounded
    if best[1] is None:
        raise PartitionError(
            f"no cut of {n} layers into stages of widths {widths} on {devices} devices fits "
            f"{memory_limit:.3g} bytes per device; allow wider stages, more devices or recomputation"
        )
    layout = best[1]
    return WidthLayout(layout.layers_per_stage, layout.widths, best[0])


def _least_fixed_bytes(costs: Mapping[int, WidthCosts], n: int) -> float:
    """The fixed bytes (parameters, gradients, optimizer state) every layout holds over all its
    ranks at the least: each layer on the width whose w ranks hold the fewest, w x fixed[k]. A stage
    of width w holds its layers' fixed bytes on each of its w ranks, and bytes held per micro-batch
    or once are never negative, so a layout fits only if this is at most devices x the memory limit."""
    return float(sum(min(w * c.fixed[k] for w, c in costs.items()) for k in range(n)))


def pipeline_floor(table: Mapping[int, WidthCosts], num_microbatches: int, devices: int) -> float:
    """A T no layout of these widths' costs on `devices` beats: each layer's least fill, plus m - 1
    bottlenecks of at least the mean rank-seconds of a micro-batch (stage s runs w_s ranks for
    t_s; sum_s w_s t_s / devices <= max_s t_s); hand-overs cost >= 0."""
    n = len(next(iter(table.values())).time)
    fill = sum(min(c.fill[k] for c in table.values()) for k in range(n))
    work = sum(min(w * c.time[k] for w, c in table.items()) for k in range(n))
    return fill + (num_microbatches - 1) * work / devices


def _thinned(candidates: list[float]) -> list[float]:
    """The bottlenecks to try: all of them up to EXACT of them; beyond, the top of each bucket
    [t, (1 + THIN) t) (each bucket's layouts are found at its top, so the answer's T is within
    a factor 1 + THIN of the optimum's)."""
    if len(candidates) <= EXACT:
        return candidates
    kept: list[float] = []
    start = candidates[0]
    for t, following in zip(candidates, candidates[1:] + [math.inf]):
        if following >= start * (1 + THIN):
            kept.append(t)
            start = following
    return kept


def _hand_overs(widths: list[int], cut_time: Sequence[float], cross: Mapping[tuple[int, int], Sequence[float]],
                n: int) -> npt.NDArray[np.float64]:
    """[a, b, i]: the hand-over of a stage of widths[a] ending before layer i to one of widths[b]
    (none at the end, i = n)."""
    hand = np.zeros((len(widths), len(widths), n + 1))
    for a, wa in enumerate(widths):
        for b, wb in enumerate(widths):
            hand[a, b, 1:n] = np.asarray(cross.get((wa, wb), cut_time), dtype=np.float64)
    return hand


def _fewest_devices(t_max: float, widths: list[int], time: dict[int, npt.NDArray[np.float64]], n: int) -> float:
    """The fewest devices whose stages, each <= t_max, cover all the layers (inf: none)."""
    fewest = np.full(n + 1, math.inf)
    fewest[n] = 0.0
    for k in range(n - 1, -1, -1):
        for w in widths:
            ok = time[w][k, k + 1:] <= t_max
            if ok.any():
                fewest[k] = min(fewest[k], w + float(np.min(fewest[k + 1:][ok])))
    return float(fewest[0])


def _piece_tables(costs: WidthCosts) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """[k, i] memory of layers k..i-1 recomputed piece by piece: (fixed + the largest piece,
    activations + the entries of the first layer and of each piece after it, per held)."""
    entry = _entry_column(costs.entry) if costs.entry else 0.0
    return (_range_sums(costs.fixed) + range_max(costs.piece_once),
            _range_sums(costs.activation) + entry + after_first(costs.piece_entry))


def _entry_column(entry: Sequence[float]) -> npt.NDArray[np.float64]:
    """[k, 0] = entry[k] (a stage starting at layer k), to add to a [k, i] table."""
    column: npt.NDArray[np.float64] = np.zeros((len(entry) + 1, 1))
    column[:-1, 0] = np.asarray(entry, dtype=np.float64)
    return column


def _range_sums(values: Sequence[float]) -> npt.NDArray[np.float64]:
    """[k, i] = sum of values[k:i] for k < i (inf elsewhere)."""
    prefix: npt.NDArray[np.float64] = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
    sums: npt.NDArray[np.float64] = prefix[None, :] - prefix[:, None]
    k, i = np.indices(sums.shape)
    sums[i <= k] = math.inf
    return sums


@dataclass(frozen=True)
class _Tables:
    """The range tables of one problem, and the program over them for a bound on the bottleneck."""

    widths: list[int]
    time: dict[int, npt.NDArray[np.float64]]
    fill: dict[int, npt.NDArray[np.float64]]
    fixed: dict[int, npt.NDArray[np.float64]]
    act: dict[int, npt.NDArray[np.float64]]
    hand: npt.NDArray[np.float64]  # [a, b, i], `_hand_overs`
    n: int
    devices: int
    m: int
    gpipe: bool
    memory_limit: float
    stages_cap: int
    pieces: dict[int, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]  # width -> `_piece_tables`

    def bottleneck(self, layout: WidthLayout) -> float:
        """The slowest stage's time of one micro-batch in `layout`."""
        bounds = np.cumsum([0, *layout.layers_per_stage])
        return max(float(self.time[w][k, i]) for w, k, i in zip(layout.widths, bounds, bounds[1:]))

    def best_under(self, t_max: float) -> tuple[float, WidthLayout] | None:
        """The least sum of fills and hand-overs with every stage <= t_max, and its layout.

        g[j][k, d, b]: layers k..n-1 in j stages on d devices, the first of width widths[b];
        choice[j][k, d, b] = (end layer, index of the next stage's width)."""
        n, devices, widths, inf = self.n, self.devices, self.widths, math.inf
        count = len(widths)
        g = [np.full((n + 1, devices + 1, count), inf)]
        g[0][n, 0, :] = 0.0  # nothing left: whatever width would come next
        choice: list[npt.NDArray[np.int64]] = [np.zeros((n + 1, devices + 1, count, 2), dtype=np.int64)]
        best: tuple[int, float, int] = (0, inf, 0)  # (stages, total, first width's index)
        columns = np.arange(devices + 1)[None, :]
        rows = np.arange(n + 1)[:, None]
        for j in range(1, self.stages_cap + 1):
            held = self.m if self.gpipe else min(j, self.m)
            table = np.full((n + 1, devices + 1, count), inf)
            picks = np.zeros((n + 1, devices + 1, count, 2), dtype=np.int64)
            prev = g[j - 1]
            for a, w in enumerate(widths):
                if w > devices:
                    continue
                need = self.fixed[w] + held * self.act[w]
                if w in self.pieces:
                    need = np.minimum(need, self.pieces[w][0] + held * self.pieces[w][1])
                ok = (self.time[w] <= t_max) & (need <= self.memory_limit)  # [k, i]
                starts, ends = np.nonzero(ok)
                if len(starts) == 0:
                    continue  # no stage of this width: its column stays inf
                shifted = np.full((n + 1, devices + 1, count), inf)  # [i, d, b]: prev[i, d - w, b] + hand
                shifted[:, w:, :] = prev[:, : devices + 1 - w, :] + self.hand[a].T[:, None, :]
                after = shifted.argmin(axis=2)  # [i, d]: the next stage's best width
                rest = shifted.min(axis=2)
                # a stage's end i = k + o runs over the band o = 1..longest stage allowed, not over
                # every i: the same sums in the same order of i, so the same minimum and argmin
                band = np.minimum(rows + np.arange(1, int((ends - starts).max()) + 1)[None, :], n)  # [k, o]
                reach = np.where(ok[rows, band] & (band > rows), self.fill[w][rows, band], inf)
                total = reach[:, :, None] + rest[band]  # [k, o, d]
                step = total.argmin(axis=1)  # [k, d]
                stop = np.take_along_axis(band, step, axis=1)  # [k, d]: the stage's end layer
                table[:, :, a] = np.take_along_axis(total, step[:, None, :], axis=1)[:, 0, :]
                picks[:, :, a, 0] = stop
                picks[:, :, a, 1] = after[stop, columns]
            g.append(table)
            choice.append(picks)
            first = int(np.argmin(table[0, devices]))
            if table[0, devices, first] < best[1]:
                best = (j, float(table[0, devices, first]), first)
        best_j, best_total, a = best
        if not math.isfinite(best_total):
            return None
        layers, chosen, k, d = [], [], 0, devices
        for j in range(best_j, 0, -1):
            end, following = (int(x) for x in choice[j][k, d, a])
            layers.append(end - k)
            chosen.append(widths[a])
            k, d, a = end, d - widths[a], following
        assert k == n and d == 0
        return best_total, WidthLayout(tuple(layers), tuple(chosen), best_total)


def brute_force_widths(costs: Mapping[int, WidthCosts], cut_time: Sequence[float], devices: int,
                       num_microbatches: int, gpipe: bool = False, memory_limit: float = math.inf,
                       cross: Mapping[tuple[int, int], Sequence[float]] | None = None) -> WidthLayout | None:
    """Every cut and every width assignment (small cases; for tests)."""
    widths = sorted(costs)
    n = len(next(iter(costs.values())).time)
    best: WidthLayout | None = None
    for p in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), p - 1):
            bounds = [0, *cuts, n]
            for assign in itertools.product(widths, repeat=p):
                if sum(assign) != devices:
                    continue
                total, worst, fits = 0.0, 0.0, True
                for s, w in enumerate(assign):
                    k, i = bounds[s], bounds[s + 1]
                    c = costs[w]
                    held = num_microbatches if gpipe else min(p - s, num_microbatches)
                    if c.memory(k, i, held) > memory_limit:
                        fits = False
                        break
                    following = assign[s + 1] if s + 1 < p else w
                    hand: Sequence[float] = (cross or {}).get((w, following), cut_time)
                    total += sum(c.fill[k:i]) + (hand[i - 1] if i < n else 0.0)
                    worst = max(worst, sum(c.time[k:i]))
                if fits:
                    value = total + (num_microbatches - 1) * worst
                    if best is None or value < best.objective - 1e-12:
                        best = WidthLayout(tuple(b - a for a, b in zip(bounds, bounds[1:])), assign, value)
    return best
