"""Pipelines whose stages have different data-parallel widths: Alpa's inter-operator pass over sub-meshes (dp, 1).

One pipeline on all the devices, stage s on w_s ranks (`Config.stage_dp`; w in 1, 2, 4, ...
below the world size, their sum the world size, tp = 1). Each replica of a stage runs an equal block
of every micro-batch's r = global_batch / m rows, so a stage of width w costs each layer what a
layout of dp = w costs it (`partition_problem` at `Setting(1, w, m)`: r / w rows), and each replica
holds the whole stage's parameters, gradients and optimizer state (ZeRO 0). Every micro-batch's rows
must divide by every stage's width (`plait.cost.row_blocks.check_rows`): for each m only the widths
that divide r are offered to `plait.search.submesh.width_partition`, which cuts the layers and gives
each stage its width, for every micro-batch count, plain schedule (1F1B, GPipe) and recomputation
(every stage or none). The step of a layout it finds, as `plait.cost.prediction.predict`'s closed form:

    pipeline    width_partition's T (fills + hand-overs + (m - 1) x the bottleneck), plus
                `handover_term` (CPU ranks: the hand-overs' time on the ranks themselves; it grows
                with the stages, so each stage count's best is found and priced: exact)
    gradients   each stage's gradients all-reduced over its w replicas (ring, `all_reduce`, on the
                link of its ranks, `Network.reduce_link`) in buckets that start when the stage's
                last gradient pass starts: stage s ends at max(P, P - B_s + all-reduce_s, P + its
                last bucket's all-reduce), P the pipeline, B_s its backward of one micro-batch;
                the latest stage counts (after the pipeline, not overlapped, where the cluster
                does not overlap them)
    closing     the loss sums' all-reduce over every rank
    optimizer   the slowest stage's optimizer step (each replica steps its whole stage)

A hand-over between widths a and b is priced per pair of replicas, all at once, on the pipeline's
slowest link (`plait.cost.row_blocks.row_crossing_time`: the busiest rank's messages and rows).
What is approximated: the partition does not see the gradients' max over
stages, so each (m, schedule, recomputation) is partitioned twice, as it is and with each layer's
all-reduce bandwidth term (not overlapped: the stages' sum bounds their max) added to its fill at
each width, and both layouts are priced as above; the one of one width a partition may return is
left to the uniform layouts (`plait.cost.tp_costs.search_tp`), which this pass has to beat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from plait.cost.buckets import bucket_summary, summed_in
from plait.cost.handovers import handover_term
from plait.cost.layer_times import layer_times
from plait.cost.network import Link, all_reduce
from plait.cost.prediction import CLOSING_BYTES, Cluster, partition_problem
from plait.cost.problem import cuts_allowed
from plait.cost.row_blocks import row_crossing_time
from plait.errors import PartitionError
from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import Setting
from plait.schedule.registry import schedule_spec, width_schedules
from plait.search.search import SearchSpace
from plait.search.submesh import WidthCosts, WidthLayout, pipeline_floor, width_partition

__all__ = ["MixedDp", "dp_widths", "dp_width_costs", "row_cut_times", "price_dp_layout", "search_dp_widths",
           "gradient_sum"]

Crossings = dict[tuple[int, int], list[float]]  # [(a, b)][k]: a cut after layer k from width a to width b


def dp_widths(world_size: int) -> tuple[int, ...]:
    """The dp widths a stage may take: 1, 2, 4, ... below the world size (a stage of every rank
    leaves no other stage)."""
    return tuple(2**k for k in range(max(1, world_size).bit_length()) if 2**k < world_size)


@dataclass(frozen=True)
class MixedDp:
    """A pipeline of stages of their own data-parallel widths, and its predicted step."""

    layers_per_stage: tuple[int, ...]
    dp: tuple[int, ...]  # replicas of each stage (Config.stage_dp)
    num_microbatches: int
    schedule: str
    recompute: bool
    pipeline_s: float  # the pipeline's closed form, with the hand-overs' time on the ranks
    step_time_s: float
    stage_s: tuple[float, ...] = ()  # each stage's F + B + W of its rows of one micro-batch
    allreduce_s: tuple[float, ...] = ()  # each stage's gradient all-reduce over its replicas (0: one)

    def to_dict(self) -> dict[str, Any]:
        return {"layers_per_stage": list(self.layers_per_stage), "dp": list(self.dp),
                "num_microbatches": self.num_microbatches, "schedule": self.schedule, "recompute": self.recompute,
                "pipeline_s": self.pipeline_s, "predicted_step_time_s": self.step_time_s,
                "stage_s": list(self.stage_s), "allreduce_s": list(self.allreduce_s)}


def dp_width_costs(costs: LayerCosts, width: int, setting: Setting, cluster: Cluster,
                   global_batch: int) -> WidthCosts:
    """Per-layer costs on each replica of a stage of `width` replicas under `setting` (its m,
    schedule and recomputation): r / width rows of each micro-batch, the whole state (ZeRO 0)."""
    p = partition_problem(costs, Setting(1, width, setting.num_microbatches, setting.schedule,
                                         recompute=setting.recompute), cluster, global_batch)
    return WidthCosts(p.time, p.fill, p.fixed, p.per_held, p.once, p.entry)


def row_cut_times(costs: LayerCosts, rows: int, cluster: Cluster, world_size: int,
                  widths: Sequence[int] = (1,)) -> Crossings:
    """[(a, b)][k]: a cut after layer k between stages of `widths` a and b, forward and back: each
    pair of replicas the rows they share of a micro-batch's `rows`, on the pipeline's slowest link
    (`row_crossing_time`); inf inside an uncuttable region."""
    link = cluster.network.link(range(world_size))
    allowed = cuts_allowed(costs.num_layers, costs.uncuttable)
    return {(a, b): [2 * row_crossing_time(costs.output_row_bytes[k] * rows, a, b, link) if allowed[k] else math.inf
                     for k in range(costs.num_layers - 1)] for a in widths for b in widths}


def search_dp_widths(costs: LayerCosts, world_size: int, global_batch: int, cluster: Cluster,
                     space: SearchSpace = SearchSpace(), beat: float = math.inf) -> MixedDp | None:
    """The fastest one-pipeline layout found whose stages take at least two different dp widths
    (see the module), over `space`'s micro-batch counts (None: powers of two), its schedules among
    1F1B and GPipe, and its recomputation. None when none applies (a world below 3, no micro-batch
    count whose rows divide by two widths), fits or is the partition's best for its (m, schedule,
    recomputation), or none found takes less than `beat` seconds a step. The (m, schedule,
    recomputation) are searched from the least `_floor` up, until the floor reaches the best step
    found (or `beat`)."""
    widths = dp_widths(world_size)
    counts = space.num_microbatches or [2**k for k in range(global_batch.bit_length()) if 2**k <= global_batch]
    schedules = [s for s in width_schedules() if s in space.schedules]
    closing = all_reduce(CLOSING_BYTES, world_size, cluster.network.reduce_link(range(world_size)))
    cases = []
    for m in counts:
        if m < 1 or global_batch % m:
            continue  # micro-batches of unequal rows cannot all divide by a width above 1
        rows = global_batch // m
        usable = [w for w in widths if rows % w == 0]  # every micro-batch's rows divide by each width
        if len(usable) < 2:
            continue
        cut_time = row_cut_times(costs, rows, cluster, world_size, usable)
        for schedule in schedules:
            for again in space.recompute:
                setting = Setting(1, 1, m, schedule, recompute=again)
                table = {w: dp_width_costs(costs, w, setting, cluster, global_batch) for w in usable}
                cases.append((_floor(costs, table, m, world_size) + closing, setting, table, cut_time))
    best: MixedDp | None = None
    for floor, setting, table, cut_time in sorted(cases, key=lambda case: case[0]):
        if floor >= min(beat, best.step_time_s if best is not None else math.inf):
            break
        for found in _layouts(costs, table, cut_time, setting, cluster, world_size):
            priced = _price(costs, found, setting, cluster, global_batch, (table, cut_time))
            if best is None or priced.step_time_s < best.step_time_s - 1e-12 * abs(priced.step_time_s):
                best = priced
    return best if best is not None and best.step_time_s < beat and math.isfinite(best.step_time_s) else None


def _floor(costs: LayerCosts, table: dict[int, WidthCosts], m: int, world_size: int) -> float:
    """A step no layout of these widths' costs beats, but for the closing all-reduce: the
    pipeline's floor (`pipeline_floor`) plus the largest layer's optimizer step (its stage steps
    at least that)."""
    return pipeline_floor(table, m, world_size) + max(costs.optimizer_s)


def _layouts(costs: LayerCosts, table: dict[int, WidthCosts], cut_time: Crossings, setting: Setting,
             cluster: Cluster, world_size: int) -> list[WidthLayout]:
    """The partition's mixed layouts of one (m, schedule, recomputation): as it is and with the
    gradients' all-reduce in the fills; where hand-overs take the ranks' time (it grows with the
    stages), the best of each stage count, fewest stages last (each answer's count - 1 is the next cap)."""
    surrogate = {w: replace(c, fill=[f + g for f, g in zip(c.fill, _gradient_terms(costs, w, cluster))])
                 for w, c in table.items()}
    out = []
    for costs_at in (table, surrogate) if any(costs.grad_bytes) else (table,):
        cap: int | None = None
        while cap is None or cap >= 2:
            try:
                found = width_partition(costs_at, cut_time[(1, 1)], world_size, setting.num_microbatches,
                                        gpipe=schedule_spec(setting.schedule).holds_all_microbatches,
                                        memory_limit=cluster.memory_bytes,
                                        max_stages=cap, cross=cut_time)
            except PartitionError:
                break
            if len(set(found.widths)) > 1:  # one width: the uniform layouts' own
                out.append(found)
            if not cluster.network.handover_cpu_s:
                break
            cap = len(found.widths) - 1
    return out


def _gradient_terms(costs: LayerCosts, width: int, cluster: Cluster) -> list[float]:
    """Each layer's share of its stage's gradient all-reduce over `width` replicas: the ring's
    bandwidth term, 2 (w - 1) / w x bytes / bandwidth (`all_reduce`; its latency is the stage's)."""
    link = cluster.network.reduce_link(range(width))
    return [2 * (width - 1) * g / (width * link.bandwidth) for g in costs.grad_bytes]


def price_dp_layout(costs: LayerCosts, layout: WidthLayout, setting: Setting, cluster: Cluster,
                    global_batch: int) -> MixedDp:
    """The predicted step of one layout (its layers and dp widths; its objective is not read) at
    `setting`'s m, schedule and recomputation, as the module prices it (memory is not checked)."""
    rows = global_batch // setting.num_microbatches
    table = {w: dp_width_costs(costs, w, setting, cluster, global_batch) for w in set(layout.widths)}
    cut_time = row_cut_times(costs, rows, cluster, sum(layout.widths), sorted(set(layout.widths)))
    return _price(costs, layout, setting, cluster, global_batch, (table, cut_time))


def _price(costs: LayerCosts, layout: WidthLayout, setting: Setting, cluster: Cluster, global_batch: int,
           terms: tuple[dict[int, WidthCosts], Crossings]) -> MixedDp:
    """`price_dp_layout` with the widths' costs and the cut times (`terms`) given."""
    table, cut_time = terms
    m, world, stages = setting.num_microbatches, sum(layout.widths), _stages(layout)
    stage_s = tuple(float(sum(table[w].time[a:b])) for w, a, b in stages)
    # T = fills + hand-overs + (m - 1) x the bottleneck (`width_partition`'s objective)
    pipeline = (sum(float(sum(table[w].fill[a:b])) for w, a, b in stages)
                + sum(cut_time[(w, after[0])][b - 1] for (w, _, b), after in zip(stages, stages[1:]))
                + (m - 1) * max(stage_s)
                + handover_term(Setting(len(stages), 1, m, setting.schedule), cluster.network.handover_cpu_s))
    after, summed, first = [], [], 0
    for w, a, b in stages:
        link = cluster.network.reduce_link(range(first, first + w))
        first += w
        past, total = gradient_sum(costs, a, b, w, link, replace(setting, dp=w), global_batch // m // w, cluster)
        after.append(past)
        summed.append(total)
    closing = all_reduce(CLOSING_BYTES, world, cluster.network.reduce_link(range(world)))
    optimizer = max(sum(costs.optimizer_s[a:b]) for _, a, b in stages)
    return MixedDp(layout.layers_per_stage, layout.widths, m, setting.schedule, setting.recompute, pipeline,
                   pipeline + max(after) + closing + optimizer, stage_s, tuple(summed))


def gradient_sum(costs: LayerCosts, first: int, end: int, replicas: int, link: Link, setting: Setting, rows: int,
                 cluster: Cluster) -> tuple[float, float]:
    """(seconds past the pipeline's end, seconds in all) of summing the gradients of layers
    first..end-1 (one stage) over `replicas` ranks on `link`: bucket by bucket (`bucket_summary`);
    with `overlap_gradients`, from the stage's last gradient pass (B, at `setting` with `rows` a
    micro-batch) on, so only what outlasts it, and the last bucket, follows the pipeline. One
    replica sums nothing."""
    if replicas == 1:
        return 0.0, 0.0
    grads = costs.grad_bytes[first:end]
    last, count = bucket_summary(grads, cluster.bucket_bytes)
    total = summed_in(count, float(sum(grads)), replicas, link)
    if not cluster.overlap_gradients:
        return total, total
    backward = sum(layer_times(costs, setting, rows)[1][first:end])
    return max(0.0, total - backward, all_reduce(last, replicas, link)), total


def _stages(layout: WidthLayout) -> list[tuple[int, int, int]]:
    """(width, first layer, end layer) of each stage."""
    out, start = [], 0
    for size, w in zip(layout.layers_per_stage, layout.widths):
        out.append((w, start, start + size))
        start += size
    return out
