"""Pipelines whose stages have different tp widths: Alpa's inter-operator pass over the tp pass's costs.

For one pipeline on all the devices (dp = 1), each tp width's per-layer costs are the tp pass's
(`plait.cost.tp_costs.at_tp`), and `plait.search.submesh.width_partition` cuts the layers and gives
each stage its width, for every micro-batch count, plain schedule (1F1B, GPipe) and recomputation
(every stage recomputes, or none: each held micro-batch keeps only its stage's input); the step adds
the closing all-reduce and the slowest stage's optimizer step to the pipeline's closed form.
A hand-over between stages of one width is the value over the pipeline's slowest link; between
two widths it is the crossing's (`plait.cost.tiles.crossing_time`, forward and back): tiles on that
link and an all-gather on the receiving stage's own, or the whole value to every receiving rank;
each way is searched (`Config.crossing`: one for every boundary) and the faster kept. The uniform
layouts are `plait.cost.tp_costs.search_tp`'s; this pass finds whether uneven widths beat them.

`search_stage_widths` runs it and the dp-width pass (`plait.search.dp_widths`) within `WIDTH_LIMITS`,
the one search `plait plan` and `Config()` both ask:

    costs + each tp width's shares (--gpt: analytic; --model and Config(): read off the graph)
      + world, rows, cluster, WidthChoices --search_stage_widths--> StageWidths (tp, dp)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from plait.plan.plan import CROSSINGS
from plait.cost.network import Network, all_reduce
from plait.cost.prediction import CLOSING_BYTES, Cluster, partition_problem
from plait.cost.problem import cuts_allowed
from plait.cost.tiles import crossing_time
from plait.cost.tp_costs import TpShares, at_tp
from plait.errors import PartitionError
from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import Setting, microbatch_rows
from plait.schedule.registry import schedule_spec, width_schedules
from plait.search.dp_widths import MixedDp, gradient_sum, search_dp_widths
from plait.search.search import SearchSpace
from plait.search.submesh import WidthCosts, pipeline_floor, width_partition

__all__ = ["MixedWidths", "search_widths", "stage_widths", "pipeline_copies", "WidthLimits", "WIDTH_LIMITS",
           "WidthChoices", "StageWidths", "search_stage_widths"]


@dataclass(frozen=True)
class WidthLimits:
    """Where the passes over stage widths run: one rule for `plait plan` and `Config()`, which plans
    on rank 0 while every other rank waits for it.

    Their cost is the dynamic program's tables (`plait.search.submesh`: layer ranges x devices, for
    each case and copy of the pipeline), so the bound is on layers^2 x devices and on the devices.
    CPU seconds measured (docs/planner.md has the table), tp pass with copies / dp pass, on GPTs of
    26-50 layers in all: 0.4-1.2 / 0.02-0.27 on 16 devices, 4.4-8.4 / 2.2-7.0 on 64, 12.1 / 8.6
    on 128 (26 layers); 64 layers on 64 devices 18.5-25.2 / 5.9-16.8, 128 layers on 16 25.6 / 2.0.
    Within these bounds the tp pass took at most 8.4 s and the dp pass 1.9 s; each tp case left
    out took 12 s or more. The dp pass stops at 16 ranks: on 64 it costs as much again as the tp
    pass, which would double `plait plan`'s 6.6 s of CPU on Alpa's GPT-39B
    (`tests/cli/test_plan_command.py` holds that plan under 10 s).
    """

    min_world_size: int = 3  # 2 ranks have no uneven split
    max_world_size: int = 64  # the tp-width pass, copies included: Alpa's scale; 128 devices took 12 s
    max_dp_world_size: int = 16  # the dp-width pass (see above)
    max_table: int = 50**2 * 64  # layers^2 x devices: Alpa's GPT-39B (50 layers) on 64 devices

    def allow(self, world_size: int, num_layers: int, dp: bool = False) -> bool:
        """Whether the tp-width pass (`dp` False) or the dp-width pass runs on `world_size` ranks
        for a model of `num_layers` layers."""
        top = self.max_dp_world_size if dp else self.max_world_size
        return self.min_world_size <= world_size <= top and num_layers**2 * world_size <= self.max_table


WIDTH_LIMITS = WidthLimits()


def stage_widths(world_size: int, devices_per_node: int) -> tuple[int, ...]:
    """The tp widths a stage may take: 1, 2, 4, 8 within a node and the world (need not divide it)."""
    return tuple(w for w in (1, 2, 4, 8) if w <= min(world_size, devices_per_node))


def pipeline_copies(world_size: int) -> tuple[int, ...]:
    """The copies (dp) of a pipeline of widths to search on `world_size` devices: every dp that
    divides it and leaves a copy 2 or more."""
    return tuple(dp for dp in range(1, world_size // 2 + 1) if world_size % dp == 0)


@dataclass(frozen=True)
class MixedWidths:
    """The best pipeline of uneven stage widths found, and its predicted step."""

    layers_per_stage: tuple[int, ...]
    widths: tuple[int, ...]
    num_microbatches: int
    schedule: str
    pipeline_s: float
    step_time_s: float
    stage_s: tuple[float, ...] = ()  # each stage's F + B + W of one micro-batch
    recompute: bool = False
    crossing: str = "tiles"  # how values cross between widths (Config.crossing)
    dp: int = 1  # copies of the pipeline, each on world / dp devices (Config.dp)
    allreduce_s: tuple[float, ...] = ()  # with dp > 1: each stage's gradient sum over the copies

    def to_dict(self) -> dict[str, Any]:
        return {"layers_per_stage": list(self.layers_per_stage), "tp": list(self.widths), "dp": self.dp,
                "num_microbatches": self.num_microbatches, "schedule": self.schedule, "recompute": self.recompute,
                "crossing": self.crossing, "allreduce_s": list(self.allreduce_s),
                "pipeline_s": self.pipeline_s, "predicted_step_time_s": self.step_time_s,
                "stage_s": list(self.stage_s)}


def search_widths(costs: LayerCosts, shares: Mapping[int, TpShares], world_size: int, global_batch: int,
                  cluster: Cluster, degrees: Sequence[int],
                  microbatches: Sequence[int] | None = None,
                  recompute: Sequence[bool] = (False, True),
                  schedules: Sequence[str] | None = None,
                  replicas: Sequence[int] = (1,)) -> MixedWidths | None:
    """The fastest layout of stages of different widths among `degrees` (each > 1 needs its
    shares): one pipeline on every device, or `replicas` copies of one (each dp dividing the
    world, on world / dp devices of at least 2); None when fewer than two widths apply or no such
    layout fits. Among equal steps, fewer copies first. `schedules` None: `width_schedules()`."""
    best: MixedWidths | None = None
    for dp in sorted(set(replicas)):
        if dp < 1 or world_size % dp or world_size // dp < 2 or global_batch < dp:
            continue
        found = _search(costs, shares, world_size, dp, global_batch, cluster, degrees, microbatches, recompute,
                        width_schedules() if schedules is None else schedules, best.step_time_s if best is not None else math.inf)
        if found is not None and (best is None or found.step_time_s < best.step_time_s):
            best = found
    return best


@dataclass(frozen=True)
class WidthChoices:
    """What the passes over stage widths may choose: the tp widths a stage may take (`degrees`:
    `stage_widths`, or the user's; fewer than two: no tp-width pass), whether the dp-width pass runs
    (tp = 1 on every stage), and `space`'s micro-batch counts (None: powers of two), schedules (those
    stages of different widths run, `width_schedules`) and recomputation."""

    degrees: tuple[int, ...] = ()
    dp: bool = False
    space: SearchSpace = SearchSpace()


@dataclass(frozen=True)
class StageWidths:
    """The best layout of stages of different tp widths and of different dp widths (None: not
    searched, or none found)."""

    tp: MixedWidths | None = None
    dp: MixedDp | None = None

    def fastest(self) -> MixedWidths | MixedDp | None:
        """The faster of the two (the tp widths' on a tie), None where neither was found."""
        return min([f for f in (self.tp, self.dp) if f is not None], key=lambda f: f.step_time_s, default=None)


def search_stage_widths(costs: LayerCosts, shares: Mapping[int, TpShares], world_size: int, global_batch: int,
                        cluster: Cluster, choices: WidthChoices, beat: float | None = None) -> StageWidths:
    """The best layouts of stages of different widths for these costs and each tp width's `shares`:
    tp widths (`search_widths`: one pipeline, or copies of one, `pipeline_copies`) and dp widths
    (`search_dp_widths`: one pipeline), each pass only within `WIDTH_LIMITS`. `plait plan` and
    `Config()` both ask here. `beat` None: each pass's best, whatever its step (`plait plan` prints
    both); a step (the best uniform layout's): the dp pass only looks for layouts faster than it and
    than the tp pass's best, as `Config()` takes only the fastest (`StageWidths.fastest`) below it."""
    space, n = choices.space, costs.num_layers
    schedules = tuple(s for s in width_schedules() if s in space.schedules)
    tp = None
    if len(set(choices.degrees)) > 1 and WIDTH_LIMITS.allow(world_size, n):
        tp = search_widths(costs, shares, world_size, global_batch, cluster, choices.degrees,
                           space.num_microbatches, space.recompute, schedules, replicas=pipeline_copies(world_size))
    dp = None
    if choices.dp and WIDTH_LIMITS.allow(world_size, n, dp=True):
        bound = math.inf if beat is None else min([beat, *([tp.step_time_s] if tp is not None else [])])
        dp = search_dp_widths(costs, world_size, global_batch, cluster, replace(space, schedules=schedules), bound)
    return StageWidths(tp, dp)


def _search(costs: LayerCosts, shares: Mapping[int, TpShares], world_size: int, dp: int, global_batch: int,
            cluster: Cluster, degrees: Sequence[int], microbatches: Sequence[int] | None,
            recompute: Sequence[bool], schedules: Sequence[str], beat: float) -> MixedWidths | None:
    """`search_widths` for `dp` copies of a pipeline on world / dp devices each: the best layout
    predicted faster than `beat`, or None."""
    devices = world_size // dp
    lanes = {1: costs} if 1 in degrees else {}
    for w in degrees:
        if w > 1 and w in shares and shares[w].splits and devices >= w:
            lanes[w] = at_tp(costs, shares[w], cluster.network.reduce_link(list(range(w))))
    if len(lanes) < 2:
        return None
    n = costs.num_layers
    per_copy = global_batch // dp
    counts = microbatches or [2**k for k in range(per_copy.bit_length()) if 2**k <= per_copy]
    closing = all_reduce(CLOSING_BYTES, world_size, cluster.network.reduce_link(range(world_size)))
    cases = []
    for index, (m, schedule, again, crossing) in enumerate(
            (m, s, r, c) for m in counts for s in schedules for r in recompute for c in CROSSINGS):
        # the cuts priced on the slowest link of a pipeline over all of a copy's devices
        chain = Setting(max(1, min(devices, n)), dp, m, schedule, recompute=again)
        cut_time = _uncut(costs, partition_problem(costs, chain, cluster, global_batch).cut_time)
        width_costs = {}
        for w, lane in lanes.items():
            p = partition_problem(lane, replace(chain, pp=1), cluster, global_batch)  # per-layer terms
            width_costs[w] = WidthCosts(p.time, p.fill, p.fixed, p.per_held, p.once, p.entry)
        rows = microbatch_rows(global_batch, dp, m)
        cross = {pair: _uncut(costs, times) for pair, times in
                 _crossings(costs, rows, list(lanes), cluster.network, devices, crossing == "whole").items()}
        floor = _floor(width_costs, lanes, m, devices) + closing
        cases.append((floor, index, m, schedule, again, crossing, width_costs, cut_time, cross, chain, rows))
    best: MixedWidths | None = None
    best_index = 0
    no_fit: set[tuple[Any, str]] = set()  # (what memory depends on, schedule) of the cases nothing fits
    for floor, index, m, schedule, again, crossing, width_costs, cut_time, cross, chain, rows in sorted(
            cases, key=lambda c: c[:2]):
        if floor > min(beat, best.step_time_s if best is not None else math.inf) * (1 + 1e-12):
            break  # no later case can beat (or tie) the best found
        # whether a layout fits does not depend on the crossing's times, and a GPipe stage holds m
        # micro-batches, 1F1B's at most as many: where 1F1B fits nothing, GPipe does not either
        memory = (m, _fit_key(width_costs, cut_time, cross))
        spec = schedule_spec(schedule)
        if (memory, schedule) in no_fit or (memory, spec.leaner) in no_fit:
            continue
        try:
            found = width_partition(width_costs, cut_time, devices, m, spec.holds_all_microbatches,
                                    cluster.memory_bytes, cross=cross)
        except PartitionError:
            no_fit.add((memory, schedule))
            continue
        if len(set(found.widths)) < 2:
            continue  # uniform: search_tp's own
        bounds = [0]
        for size in found.layers_per_stage:
            bounds.append(bounds[-1] + size)
        stages = list(zip(found.widths, bounds, bounds[1:]))
        optimizer = max(sum(lanes[w].optimizer_s[a:b]) for w, a, b in stages)
        summed = _copies_sum(lanes, stages, dp, devices, chain, rows, cluster)
        step = found.objective + max(past for past, _ in summed) + closing + optimizer
        tie = 1e-15 * max(1.0, abs(step))
        if best is None or step < best.step_time_s - tie or (step <= best.step_time_s + tie and index < best_index):
            best_index = index  # among equal steps, the first in (m, schedule, recompute, crossing) order
            best = MixedWidths(found.layers_per_stage, found.widths, m, schedule, found.objective, step,
                               tuple(float(sum(width_costs[w].time[a:b])) for w, a, b in stages), again, crossing,
                               dp, tuple(total for _, total in summed) if dp > 1 else ())
    return best if best is not None and math.isfinite(best.step_time_s) and best.step_time_s < beat else None


def _copies_sum(lanes: Mapping[int, LayerCosts], stages: Sequence[tuple[int, int, int]], dp: int, devices: int,
                setting: Setting, rows: int, cluster: Cluster) -> list[tuple[float, float]]:
    """Per stage (width, first, end layer) of `dp` copies of a pipeline: (seconds its gradient sum
    over the copies' ranks of that stage, `devices` apart, ends after the pipeline, the sum's
    seconds), priced as a stage of replicas is (`plait.search.dp_widths.gradient_sum`)."""
    out, first = [], 0
    for w, a, b in stages:
        link = cluster.network.reduce_link([first + k * devices for k in range(dp)])
        first += w
        out.append(gradient_sum(lanes[w], a, b, dp, link, setting, rows, cluster))
    return out


def _fit_key(table: Mapping[int, WidthCosts], cut_time: Sequence[float],
             cross: Mapping[tuple[int, int], Sequence[float]]) -> tuple[Any, ...]:
    """What decides whether any layout fits (`width_partition` raising or not): each width's bytes
    and where a cut is allowed at all (a finite hand-over); not the stages' or the crossings' times."""
    return (tuple((w, tuple(c.fixed), tuple(c.activation), tuple(c.once), tuple(c.entry), tuple(c.piece_once),
                   tuple(c.piece_entry)) for w, c in sorted(table.items())),
            tuple(math.isfinite(t) for t in cut_time),
            tuple((pair, tuple(math.isfinite(t) for t in times)) for pair, times in sorted(cross.items())))


def _floor(table: Mapping[int, WidthCosts], lanes: Mapping[int, LayerCosts], m: int, devices: int) -> float:
    """A step no layout of these widths beats, but for the closing all-reduce: the pipeline's floor
    (`pipeline_floor`) and the largest layer's least optimizer step."""
    n = len(next(iter(table.values())).time)
    optimizer = max(min(lanes[w].optimizer_s[k] for w in table) for k in range(n))
    return pipeline_floor(table, m, devices) + optimizer


def _uncut(costs: LayerCosts, cut_time: Sequence[float]) -> list[float]:
    """`cut_time` with inf at the cuts inside an uncuttable region (no stage boundary there)."""
    return [t if ok else math.inf for t, ok in zip(cut_time, cuts_allowed(costs.num_layers, costs.uncuttable))]


def _crossings(costs: LayerCosts, rows: int, widths: list[int], network: Network, world_size: int,
               whole: bool) -> dict[tuple[int, int], list[float]]:
    """[(a, b)][k]: a cut after layer k crossing from a stage of width a to one of width b, forward
    and back, on the pipeline's slowest link (each stage all-gathers on its own)."""
    link = network.link(range(world_size))
    local = {w: network.reduce_link(range(w)) for w in widths}
    out = {}
    for a in widths:
        for b in widths:
            if a != b:
                out[(a, b)] = [crossing_time(v * rows, a, b, link, local[b], whole)
                               + crossing_time(v * rows, b, a, link, local[a], whole)
                               for v in costs.output_row_bytes[:-1]]
    return out
