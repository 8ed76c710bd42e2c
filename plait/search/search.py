"""The search: layouts of a world (pp x dp, micro-batches, schedule, recomputation, ZeRO, batched W), best first.

For each setting the exact partition (`optimal_partition`) gives the layers per stage that
minimise the schedule's closed-form latency within the memory limit; the cost model prices
the layout in full (all-reduce, optimizer). Settings are visited in order of a lower bound on
their pipeline time and the visit stops once that bound cannot beat the `keep`-th best found
(branch and bound: a setting is skipped only when it cannot enter the table). The best by the
closed form are then timed again on the schedule's own program (`steptime`) and re-ranked.
Tensor parallelism is searched around this (`plait.cost.tp_costs.search_tp`: each tp on world / tp
ranks); here tp = 1, and a layer that fits no device makes every setting infeasible, with the reason. ZeRO (0-3: `plait.cost.memory`;
3 with every schedule and batched weight gradients too) is searched where dp > 1;
left to the search (`SearchSpace.zero` None) it is used where memory needs it: the candidates
are those of the lowest level at which some layout fits. Batched weight gradients
(`Config.batch_weight_grads`) are one more choice, priced by `plait.cost.layer_times`. Candidates
that predict the same step (to 12 significant digits) rank by the lower level, then unbatched
first, then in the order found. Offload (`SearchSpace.offload`: zero=3's shards and optimizer in
host memory) is taken, like a level above 3, only where nothing fits without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from plait.cost.prediction import (
    Cluster,
    Prediction,
    Setting,
    partition_problem,
    predict,
    step_lower_bound,
)
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import SEARCHED_ZERO, check_zero
from plait.schedule.registry import SCHEDULE_NAMES, SEARCH_ORDER, schedule_spec
from plait.search.partition import Infeasible
from plait.search.solved import SolvedPartitions

__all__ = ["SearchSpace", "Candidate", "search", "format_table"]

GIB = 2.0**30


@dataclass(frozen=True)
class SearchSpace:
    """Which settings the search may pick from (None: all sensible values)."""

    pp: tuple[int, ...] | None = None  # None: every divisor of the world size, up to the layers
    num_microbatches: tuple[int, ...] | None = None  # None: powers of two and multiples of pp
    schedules: tuple[str, ...] = field(default_factory=lambda: tuple(SEARCH_ORDER))  # the registered ones
    num_virtual_stages: int = 2  # chunks per rank of "interleaved"
    recompute: tuple[bool, ...] = (False, True)
    zero: tuple[int, ...] | None = None  # None: 0-3 where dp > 1 (else 0); given: only those
    zero3: bool = True  # False: zero=3 not tried where zero is None (replanning: not run yet)
    batch_weight_grads: tuple[bool, ...] = (False, True)  # True: tried with m > 1, without recomputation or ZB-H1
    offload: tuple[bool, ...] = (False,)  # True: zero=3 with its shards and optimizer in host memory (Config.offload)
    keep: int = 5  # candidates returned
    simulate_top: int = 8  # at most this many re-timed on the schedule's program
    simulate_actions: int = 40_000  # actions simulated in all; beyond, the closed form stays

    def __post_init__(self) -> None:
        for level in self.zero or ():
            check_zero(level, 2)
        for name in self.schedules:  # as `Setting` says it
            if name not in SCHEDULE_NAMES:
                raise ConfigError(f"schedule={name!r} is not known; choose one of {list(SCHEDULE_NAMES)}")

    def zero_levels(self, dp: int) -> tuple[int, ...]:
        """The ZeRO levels to try with dp replicas per stage (1 and 2 need dp > 1)."""
        levels = SEARCHED_ZERO if self.zero is None else tuple(sorted(set(self.zero)))
        if self.zero is None and not self.zero3:
            levels = tuple(z for z in levels if z != 3)
        return tuple(z for z in levels if z == 0 or dp > 1)


@dataclass(frozen=True)
class Candidate:
    """One setting with its optimal layout and prediction, or why it cannot run."""

    setting: Setting
    feasible: bool
    reason: str = ""
    layers_per_stage: tuple[int, ...] = ()
    prediction: Prediction | None = None
    closed_form_s: float = math.inf  # the step time by the closed form
    needed_memory_bytes: float = 0.0  # infeasible: the least any layout needs per device
    layer_names: tuple[str, ...] = field(default=(), repr=False)
    tp: int = 1  # tensor-parallel ranks per stage (`plait.cost.tp_costs.search_tp`)

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s if self.prediction is not None else math.inf

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the degrees, schedule, stages, prediction and feasibility."""
        st, pred = self.setting, self.prediction
        data: dict[str, Any] = {
            "pp": st.pp, "dp": st.dp, "tp": self.tp, "num_microbatches": st.num_microbatches,
            "schedule": st.schedule, "num_virtual_stages": st.num_virtual_stages,
            "recompute": st.recompute, "zero": st.zero, "batch_weight_grads": st.batch_weight_grads,
            "offload": st.offload,
            "recompute_by_layer": list(pred.recompute_by_layer) if pred else [],
            "layers_per_stage": list(self.layers_per_stage),
            "feasible": self.feasible,
            "predicted_step_time_s": pred.step_time_s if pred else None,
            "closed_form_step_time_s": self.closed_form_s if self.feasible else None,
            "timing": pred.method if pred else None,
            "peak_memory_bytes": pred.peak_memory_bytes if pred else self.needed_memory_bytes,
            "stages": [],
        }
        if not self.feasible:
            data["reason"] = self.reason
        if pred is not None:  # per rank position (each replica alike)
            for name in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes"):
                data[name] = list(getattr(pred, name))
            for s in pred.stages:
                names = self.layer_names[s.start:s.end]
                data["stages"].append({
                    "stage": s.stage_index, "rank": s.rank, "layers": list(names),
                    "first_layer": s.start, "num_layers": s.end - s.start,
                    "forward_s": s.forward_s, "backward_s": s.backward_s, "weight_s": s.weight_s,
                    "time_s": s.forward_s + s.backward_s + s.weight_s, "send_s": s.send_s,
                    "memory_bytes": pred.memory_bytes[s.rank],
                })
        return data


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _settings(costs: LayerCosts, world_size: int, global_batch: int, space: SearchSpace) -> list[Setting]:
    out: list[Setting] = []
    for pp in space.pp or _divisors(world_size):
        if world_size % pp or pp > costs.num_layers:
            continue
        dp = world_size // pp
        replica_rows = math.ceil(global_batch / dp)
        if space.num_microbatches is not None:
            counts = sorted(set(space.num_microbatches))
        else:
            counts = sorted({2**k for k in range(replica_rows.bit_length())}
                            | {pp * 2**k for k in range(replica_rows.bit_length())})
        for m in (c for c in counts if c <= replica_rows):
            single = [n for n in space.schedules if not schedule_spec(n).virtual]
            first = SEARCH_ORDER[0]  # the planner's first choice (1F1B)
            one = first if first in single else (single[0] if single else None)
            for name in space.schedules:
                if pp == 1 and name != one:
                    continue  # one stage: the schedules differ only in what GPipe holds
                spec = schedule_spec(name)
                v = space.num_virtual_stages if spec.virtual else 1
                if spec.virtual and (v < 2 or pp < 2 or pp * v > costs.num_layers):
                    continue
                for recompute in space.recompute:
                    for batched in space.batch_weight_grads:
                        if batched and (recompute or spec.splits_backward or m == 1):
                            continue  # it would keep what recomputation frees; ZB-H1 would be 1F1B; m=1: no change
                        out.extend(Setting(pp, dp, m, name, v, recompute, zero, batched, offload)
                                   for zero in space.zero_levels(dp)
                                   for offload in (space.offload if zero == 3 else (False,)))
    return out


def _loosest(setting: Setting, space: SearchSpace) -> Setting:
    """The sibling of `setting` whose partition needs the least memory with the same objective:
    1F1B's held micro-batches for GPipe's (one closed form), ZeRO's highest level searched."""
    leaner = schedule_spec(setting.schedule).leaner
    schedule = leaner if leaner is not None and leaner in space.schedules else setting.schedule
    zero = max(space.zero_levels(setting.dp), default=setting.zero)
    return replace(setting, schedule=schedule, zero=zero, offload=zero == 3 and max(space.offload))


def _evaluate(costs: LayerCosts, setting: Setting, cluster: Cluster, global_batch: int,
              solved: SolvedPartitions, space: SearchSpace) -> Candidate:
    """`setting`'s optimal layout, priced. Settings that differ only in memory (ZeRO levels,
    GPipe and 1F1B) share their partition where the loosest one's layout fits (`plait.search.solved`)."""
    problem = partition_problem(costs, setting, cluster, global_batch)
    loosest = _loosest(setting, space)
    found = solved.solve(problem, (lambda: partition_problem(costs, loosest, cluster, global_batch))
                         if loosest != setting else None)
    if isinstance(found, Infeasible):  # interleaved chunks each get 1/v of the device: v times a chunk's
        return Candidate(setting, False, found.reason, needed_memory_bytes=found.least_memory
                         * setting.num_virtual_stages, layer_names=costs.names)
    pred = predict(costs, setting, cluster, global_batch, found.layers_per_stage, simulate=False)
    return Candidate(setting, True, "", found.layers_per_stage, pred, pred.step_time_s,
                     layer_names=costs.names)


def search(costs: LayerCosts, world_size: int, global_batch: int, cluster: Cluster,
           space: SearchSpace = SearchSpace()) -> list[Candidate]:
    """The best `space.keep` feasible candidates, fastest first; if none is feasible, the
    infeasible ones needing the least memory, each with its reason."""
    if world_size < 1 or global_batch < 1:
        raise ConfigError(
            f"world_size={world_size} and global_batch={global_batch} must both be >= 1"
        )
    settings = _settings(costs, world_size, global_batch, space)
    if not settings:
        raise ConfigError(
            f"no setting to search on {world_size} devices for {costs.num_layers} layers and a "
            f"batch of {global_batch} (pp options {space.pp}, micro-batches "
            f"{space.num_microbatches}, schedules {space.schedules}, zero {space.zero}; zero 1 "
            "and 2 need dp > 1); widen the search space"
        )
    bounds = sorted((step_lower_bound(costs, s, cluster, global_batch), i) for i, s in enumerate(settings))
    feasible: list[Candidate] = []
    infeasible: list[Candidate] = []
    solved = SolvedPartitions()
    for bound, i in bounds:
        if len(feasible) >= space.keep and bound >= feasible[space.keep - 1].closed_form_s:
            break  # sorted by bound: nothing left can enter the table
        candidate = _evaluate(costs, settings[i], cluster, global_batch, solved, space)
        (feasible if candidate.feasible else infeasible).append(candidate)
        feasible.sort(key=lambda c: _rank(c.closed_form_s, c))
    if space.zero is None and feasible:  # ZeRO where memory needs it: the lowest level that fits
        lowest = min(c.setting.zero for c in feasible)
        feasible = [c for c in feasible if c.setting.zero == lowest]
    if len(space.offload) > 1 and any(not c.setting.offload for c in feasible):  # offload where only it fits
        feasible = [c for c in feasible if not c.setting.offload]
    if not feasible:
        infeasible.sort(key=lambda c: (c.needed_memory_bytes, c.setting.pp))
        top = infeasible[0]
        infeasible[0] = replace(top, reason=_summary(top, world_size, cluster, space))
        return infeasible[: space.keep]
    return _refine(costs, feasible, cluster, global_batch, space)[: space.keep]


def _summary(closest: Candidate, world_size: int, cluster: Cluster, space: SearchSpace) -> str:
    """Why nothing fits, and what is missing, around the closest candidate's own reason."""
    st = closest.setting
    tried_all = True in space.recompute and space.num_microbatches is None
    tried_zero = space.zero is None or any(z > 0 for z in space.zero)
    if tried_all and tried_zero:
        missing = ("needs tensor parallelism (tp > 1): no pipeline x data-parallel layout with "
                   "ZeRO, recomputation and one-row micro-batches fits")
    elif tried_all:
        missing = ("needs tensor parallelism (tp > 1) or sharded optimizer state (ZeRO): no "
                   "pipeline x data-parallel layout with recomputation and one-row micro-batches fits")
    else:
        missing = "try recomputation, smaller micro-batches, ZeRO or tensor parallelism"
    return (
        f"{missing}; no layout on {world_size} devices fits {cluster.memory_bytes / GIB:.2f} GiB "
        f"per device with tp=1; the closest (pp={st.pp}, dp={st.dp}, {st.num_microbatches} "
        f"micro-batches, {st.schedule}, recompute={st.recompute}, zero={st.zero}) needs "
        f"{closest.needed_memory_bytes / GIB:.2f} GiB: {closest.reason}"
    )


def _refine(costs: LayerCosts, ranked: list[Candidate], cluster: Cluster, global_batch: int,
            space: SearchSpace) -> list[Candidate]:
    """Re-time the leaders on the schedule's program until the top `keep` are all simulated
    (or `simulate_top` were, or the rest are too large to simulate quickly)."""
    budget = space.simulate_actions
    for _ in range(space.simulate_top):
        ranked.sort(key=lambda c: _rank(c.step_time_s, c))
        todo = [c for c in ranked[: space.keep]
                if c.prediction is not None and c.prediction.method != "simulated"
                and _actions(c.setting) <= budget]
        if not todo:
            break
        c = todo[0]
        pred = predict(costs, c.setting, cluster, global_batch, c.layers_per_stage, simulate=True)
        ranked[ranked.index(c)] = replace(c, prediction=pred)
        budget -= _actions(c.setting)
    ranked.sort(key=lambda c: _rank(c.step_time_s, c))
    return ranked


def _rank(step_time_s: float, candidate: Candidate) -> tuple[float, int, bool]:
    """Faster first; steps equal to 12 significant digits go to the lower ZeRO level, then to
    weight gradients per micro-batch (less memory)."""
    st = candidate.setting
    return float(f"{step_time_s:.12g}"), st.zero + st.offload, st.batch_weight_grads


def _actions(setting: Setting) -> int:
    """F, B (and W) of every micro-batch on every stage: the program the simulation walks."""
    ops = 3 if schedule_spec(setting.schedule).splits_backward and not setting.recompute else 2
    return ops * setting.num_chunks * setting.num_microbatches


def format_table(candidates: list[Candidate], top: int = 5) -> str:
    """The chosen candidate's stages (layers, time, memory), then the alternatives, one a line
    (the first `top`, and the best of each tp beyond them)."""
    if not candidates:
        return "no candidate"
    best = candidates[0]
    lines = []
    header = (f"{'#':>2} {'pp':>3} {'dp':>3} {'tp':>2} {'m':>5} {'schedule':<14} {'recompute':<9} "
              f"{'zero':>4} {'step (s)':>10} {'peak memory':>12}  timing")
    lines.append(header)
    rows = candidates[:top]
    rows += [c for c in candidates[top:] if c.tp not in {r.tp for r in rows}]  # each tp's best
    for k, c in enumerate(rows, 1):
        st = c.setting
        sched = (st.schedule + (f" v={st.num_virtual_stages}" if st.num_virtual_stages > 1 else "")
                 + (" +bW" if st.batch_weight_grads else ""))
        step = f"{c.step_time_s:10.4f}" if c.feasible else f"{'-':>10}"
        mem = (c.prediction.peak_memory_bytes if c.prediction else c.needed_memory_bytes) / GIB
        timing = c.prediction.method if c.prediction else "infeasible: " + c.reason
        again = ("by layer" if c.prediction and c.prediction.recompute_by_layer else "yes") if st.recompute else "no"
        lines.append(f"{k:>2} {st.pp:>3} {st.dp:>3} {c.tp:>2} {st.num_microbatches:>5} {sched:<14} "
                     f"{again:<9} {str(st.zero) + ('+o' if st.offload else ''):>4} {step} {mem:9.2f} GiB  {timing}")
    if best.prediction is not None:
        pred = best.prediction
        lines.append(f"chosen: {best.setting.num_microbatches} micro-batches of {pred.rows} rows, "
                     f"zero={best.setting.zero}{' offloaded' if best.setting.offload else ''}{f', tp={best.tp}' if best.tp > 1 else ''}"
                     f"{', weight gradients batched over the step (+bW)' if best.setting.batch_weight_grads else ''}"
                     "; per stage, one "
                     f"micro-batch, and its rank's memory "
                     "(parameters + gradients + optimizer state + activations):")
        for s in pred.stages:
            names = best.layer_names[s.start:s.end]
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            lines.append(
                f"  stage {s.stage_index:>2} (rank {s.rank}): layers {s.start}-{s.end - 1} "
                f"({len(names)}: {shown})  F+B+W {1e3 * (s.forward_s + s.backward_s + s.weight_s):.3f} ms"
                f"  send {1e3 * s.send_s:.3f} ms  memory {pred.memory_bytes[s.rank] / GIB:.2f} GiB"
                f" ({_parts(pred, s.rank)})"
            )
    return "\n".join(lines)



def _parts(pred: Prediction, rank: int) -> str:
    """A rank's memory as parameters + gradients + optimizer state + activations, in GiB."""
    parts = (pred.parameter_bytes, pred.gradient_bytes, pred.optimizer_bytes, pred.activation_bytes)
    return " + ".join(f"{part[rank] / GIB:.2f}" for part in parts)
