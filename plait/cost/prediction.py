"""The cost model: a layout's stage times, memory and predicted step time, from `LayerCosts`.

One step of a layout (pp stages x dp replicas, m micro-batches of `rows` rows each):

    pipeline   the schedule timed with per-stage F, B, W (sums of the layers' times; a
               recomputed stage adds its forward to B and runs W inside B) and, at each cut,
               the activation bytes (= the gradient bytes coming back) over the cut's link;
               `plait.schedule.steptime` on the generator's own program, or the closed form
               that the partition minimises (`partition_problem`); where hand-overs take time
               from the ranks themselves (`Network.handover_cpu_s`, CPU ranks), each chunk's F
               and B add it once per boundary it sends or receives across (`plait.cost.handovers`)
    gradients  each rank's gradients summed over its dp replicas, in buckets
               (`plait.cost.buckets`): all-reduced (zero 0 and 1; ring 2(p-1)/p x bytes /
               bandwidth, Thakur et al. 2005) or, ZeRO-2, reduced to their owners (as the
               runtime does it: p reduces of bytes/p, each over a binary tree, `by_owner`:
               log2(p) x bytes / bandwidth in all), plus a latency for each collective
               the runtime issues (`bucket_summary`); on the link the backend's
               all-reduce was measured at. The buckets start when the rank's last gradient
               pass starts, so they overlap that pass only, and the last bucket -- the first
               layers' gradients -- cannot start before the pass has ended (ZeRO-3 with a
               split backward or batched weight gradients: all of them after the last ones)
    closing    every rank's loss and metric sums, one small all-reduce over all ranks after
               its gradients: the step's one point where every rank meets. Not in a pipeline
               of one rank per stage (dp = 1): there the sums ride on the stages' own messages
               (`plait.runtime.riding_sums`), and each rank goes on to its optimizer step alone
    optimizer  the rank's optimizer step, after the closing all-reduce; with ZeRO (1 or 2)
               each replica steps 1/dp of its stage's parameters, then the owners broadcast
               them (`by_owner` of the trainable parameters' bytes), not overlapped; ZeRO-3
               all-gathers each piece's for each pass; with offload the host steps the shards
               (at its memory's bandwidth), each gather copies a shard in over the host link
               and the summed gradients go out, not overlapped

step = max over ranks of max(pipeline end, last gradient pass start + gradient sum, pipeline
end + the last bucket's) (pipeline end + gradient sum where they cannot overlap), + closing all-reduce, + the slowest rank's optimizer step (and
ZeRO's broadcasts); with dp = 1, max over ranks of the rank's pipeline end + its optimizer step. Memory of a rank = parameters + gradients + optimizer state
(`plait.cost.memory`: ZeRO's shares) + the activations of the micro-batches the schedule makes
it hold at once (its peak); recomputation keeps only each held micro-batch's stage input, plus
one micro-batch's activations while it is recomputed -- or, recomputed layer by layer
(`plait.cost.recompute_pieces`) where that needs less, each layer's input and one layer's
activations. Batched weight gradients
(`plait.cost.layer_times`): each rank's W over all micro-batches after its last action, its
last gradient pass; every micro-batch's linear inputs and output gradients held. Left out: tensor parallelism, compute
slowed by concurrent communication, allocator fragmentation and framework workspace.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

from plait.cost.buckets import DEFAULT_BUCKET_BYTES, bucket_summary, summed_in
from plait.cost.handovers import boundary_links, cut_bytes, cut_times, handover_busy, handover_term, slowest_boundary
from plait.cost.layer_times import (flush_times, hold, latency_terms, layer_times, pipeline_lower_bound,
                                    recomputed_memory)
from plait.cost.memory import StateBytes, state_bytes, state_totals
from plait.cost.network import Network, all_gather, all_reduce, by_owner, messages_time, point_to_point, reduce_scatter
from plait.cost.problem import PartitionProblem
from plait.cost.recompute_pieces import piece_terms
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import Setting, microbatch_rows, peak_activations
from plait.schedule.registry import schedule_spec
from plait.schedule.steptime import compile_schedule, time_step

__all__ = ["Setting", "Cluster", "StageCost", "Prediction", "microbatch_rows", "peak_activations", "partition_problem",
           "pipeline_lower_bound", "step_lower_bound", "predict"]

CLOSING_BYTES = 64.0  # the step's loss and metric sums (and non-finite flags): a few float64s


@dataclass(frozen=True)
class Cluster:
    """Where a job runs: its network, the bytes one device may use, the optimizer's state.

    optimizer_state_factor: optimizer state bytes per gradient byte (Adam 2: exp_avg and exp_avg_sq;
    SGD with momentum 1; plain SGD 0). bucket_bytes: the cap of a gradient bucket (`Config.bucket_cap_mb`).
    overlap_gradients: the gradient sum starts while the last gradient pass runs, as plait's runtime
    does it (False: after the pipeline, as Megatron-LM's local DDP of 2021 all-reduces its gradient
    buffer once the forward-backward pass has returned). owner_reduces: ZeRO-2 reduces each bucket to
    its owners (False: all-reduces it, as the runtime does on gloo; `plait.cost.buckets.reduces_to_owners`).
    recompute_by_layer: a recomputed stage may recompute layer by layer where that needs less memory
    (False: `Config(recompute_by_layer=False)`). ride_sums: in a pipeline of one rank per stage (dp = 1)
    the step's loss sums ride on the stages' messages, no all-reduce (False: lanes of tp ranks, whose
    sums take the all-reduce). host_link, host_bandwidth: bytes/s between a device and its host's
    memory, and of host memory per device (`Device`'s); 0: the device is the host (CPU ranks).
    """

    network: Network
    memory_bytes: float
    optimizer_state_factor: float = 2.0
    bucket_bytes: float = DEFAULT_BUCKET_BYTES
    overlap_gradients: bool = True
    owner_reduces: bool = True
    recompute_by_layer: bool = True
    ride_sums: bool = True
    host_link: float = 0.0
    host_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not self.memory_bytes > 0:
            raise ConfigError(f"memory_bytes must be > 0, got {self.memory_bytes!r}")
        if not (math.isfinite(self.optimizer_state_factor) and self.optimizer_state_factor >= 0):
            raise ConfigError(
                f"optimizer_state_factor must be >= 0 (Adam: 2), got {self.optimizer_state_factor!r}"
            )
        if not (math.isfinite(self.bucket_bytes) and self.bucket_bytes > 0):
            raise ConfigError(f"bucket_bytes must be > 0 (the default: 25 MiB), got {self.bucket_bytes!r}")


@dataclass(frozen=True)
class StageCost:
    """One stage (model chunk): its layers, per-micro-batch times and its share of memory."""

    stage_index: int
    rank: int  # position in the pipeline (replica 0's rank)
    start: int  # first layer
    end: int  # one past the last layer
    forward_s: float
    backward_s: float  # input gradient, plus the recomputed forward
    weight_s: float  # weight gradient (0 when recomputed: it runs inside B; or batched)
    send_s: float  # hand-over across the cut after this stage (0 on the last)
    state_bytes: float  # parameters + gradients + optimizer state (its ZeRO share)
    activation_bytes: float  # one micro-batch's activations (kept, or recomputed)
    entry_bytes: float  # one micro-batch's input to the stage
    flush_s: float = 0.0  # batch_weight_grads: the step's weight gradients, after the rank's last action
    layer_entry_bytes: float = 0.0  # recomputed by layer: one micro-batch's input to each layer (piece)
    layer_activation_bytes: float = 0.0  # ... and the largest piece's activations of one

    def recomputed(self, held: float) -> tuple[float, float, bool]:
        """(bytes kept per held micro-batch, bytes while recomputing, by layer) of the two ways
        this stage can recompute, whichever needs less holding `held` micro-batches."""
        whole = (self.entry_bytes, self.activation_bytes, False)
        if not self.layer_activation_bytes:
            return whole
        layered = (self.layer_entry_bytes, self.layer_activation_bytes, True)
        return min(whole, layered, key=lambda form: held * form[0] + form[1])

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step and memory, per stage and in total; tuples per rank position.

    memory_bytes is each rank's peak: parameter + gradient + optimizer + activation bytes (the
    backward's peak; `plait.cost.memory`)."""

    stages: tuple[StageCost, ...]
    pipeline_s: float
    allreduce_s: tuple[float, ...]  # the gradients' sum: all-reduce, or ZeRO-2's reduces to the owners
    closing_s: float  # the all-reduce of the step's loss sums over every rank
    optimizer_s: tuple[float, ...]  # the optimizer step (ZeRO: of this replica's share)
    memory_bytes: tuple[float, ...]
    step_time_s: float
    method: str  # "simulated" or "closed form"
    rows: int  # rows of one micro-batch
    gather_s: tuple[float, ...] = ()  # ZeRO: the owners' broadcasts of updated parameters (() = zeros)
    parameter_bytes: tuple[float, ...] = ()
    gradient_bytes: tuple[float, ...] = ()  # the peak, during the backward
    optimizer_bytes: tuple[float, ...] = ()
    activation_bytes: tuple[float, ...] = ()
    recompute_by_layer: tuple[int, ...] = ()  # recomputed stages that recompute layer by layer

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_bytes)


def riding(setting: Setting, cluster: Cluster) -> bool:
    """Whether the step's loss sums ride on the pipeline's messages instead of an all-reduce:
    one rank per stage (`plait.runtime.step.rides`)."""
    return cluster.ride_sums and setting.dp == 1 and setting.pp > 1


@functools.lru_cache(maxsize=64)
def _closing(network: Network, world_size: int) -> float:
    return all_reduce(CLOSING_BYTES, world_size, network.reduce_link(range(world_size)))


def partition_problem(costs: LayerCosts, setting: Setting, cluster: Cluster, global_batch: int) -> PartitionProblem:
    """The closed form the partition minimises for `setting`, with memory per stage.

    1F1B and GPipe: T = sum_s t_s + 2 sum_cuts c + (m - 1) max_s t_s, t = F + B + W (Alpa eq. 2;
    exactly simulate's step for uniform stages, and for GPipe whenever B/F is the same on every
    stage). ZB-H1 (W split off), m >= p: fill F + B - W per stage plus 2W on the last, the paper's
    m(F+B+W) + (p-1)(F+B-W) for uniform stages; m < p: t = F + B and one W more, (m + p - 1)(F + B)
    + W. Interleaved (v chunks per rank), m >= p: the chunks' fill counts 1/v and the bottleneck
    m v - 1 times, Megatron's (m + (p-1)/v) t for uniform chunks; m < p: a plain pipeline of its
    p v chunks (`layer_times._modes`). Every cut counts whole: a micro-batch crosses all p v - 1 of
    them in turn (within 17% of simulate's step for uniform chunks and hand-overs up to a fifth of
    a chunk; exact without hand-overs). Each chunk must fit in 1/v of the device, a sufficient
    condition for the rank. Batched weight gradients: t = F + B + W(m rows)/m, and W(m rows)/m
    more on the last stage (`_terms`); every micro-batch held (`DEFERRED_HOLD`)."""
    rows = microbatch_rows(global_batch, setting.dp, setting.num_microbatches)
    time, fill, last_fill, count = latency_terms(costs, setting, rows)
    v = setting.num_virtual_stages
    cuts = [2 * c for c in cut_times(costs, setting, cluster.network, rows)]
    state = state_totals(costs.param_bytes, costs.grad_bytes, cluster.optimizer_state_factor, setting.dp, setting.zero,
                         costs.copy_bytes, offloaded(setting, cluster), schedule_spec(setting.schedule).splits_backward)
    act = [a * rows for a in costs.activation_row_bytes]
    entry = [costs.input_row_bytes * rows] + [o * rows for o in costs.output_row_bytes[:-1]]
    peaks = peak_activations(setting)
    held = [peaks[s % setting.pp] for s in range(setting.num_chunks)]
    recomputed = recomputed_memory(setting)
    by_layer = recomputed and cluster.recompute_by_layer
    piece_entry, piece_once = piece_terms(costs.names, act, entry) if by_layer else ((), ())
    return PartitionProblem(
        time=time, fill=fill, last_fill=last_fill, cut_time=cuts, bottleneck_count=count,
        num_chunks=setting.num_chunks, fixed=state, held=held,
        per_held=[0.0] * len(act) if recomputed else [hold(setting) * a for a in act],
        once=act if recomputed else (), entry=entry if recomputed else (),
        memory_limit=cluster.memory_bytes / v, uncuttable=costs.uncuttable, names=costs.names,
        piece_once=piece_once, piece_entry=piece_entry,
    )


def step_lower_bound(costs: LayerCosts, setting: Setting, cluster: Cluster, global_batch: int) -> float:
    """A bound no layout of `setting` beats in `predict`'s closed form, for the search's branch
    and bound: `pipeline_lower_bound` with the cheapest num_chunks - 1 cuts (every layout pays
    that many), the hand-overs' CPU time, the closing all-reduce, and the optimizer step of the
    average rank (the slowest steps at least that). The gradient sum and the ZeRO broadcasts,
    which may hide behind the pipeline or not, are left out."""
    rows = microbatch_rows(global_batch, setting.dp, setting.num_microbatches)
    nbytes, messages = cut_bytes(costs.output_row_bytes, costs.uncuttable)
    cheapest = min(setting.num_chunks - 1, len(nbytes) - 1)
    cut_floor = 2 * messages_time(int(messages[cheapest]), float(nbytes[cheapest]) * rows,
                                  slowest_boundary(setting, cluster.network))
    if riding(setting, cluster):  # no meeting, and the rank that ends last may step little
        closing, stepped = 0.0, 0.0
    else:
        closing = _closing(cluster.network, setting.pp * setting.dp)
        stepped = sum(costs.optimizer_s) / setting.pp / (setting.dp if setting.zero else 1)
    bound = (pipeline_lower_bound(costs, setting, global_batch) + cut_floor
             + handover_term(setting, cluster.network.handover_cpu_s) + closing + stepped)
    return bound * (1 - 1e-9)  # sums in another order than predict's: a little below, never above


def _stages(costs: LayerCosts, setting: Setting, cluster: Cluster, rows: int,
            layers_per_stage: Sequence[int]) -> list[StageCost]:
    f, b, w = layer_times(costs, setting, rows)
    flush = flush_times(costs, setting, rows)
    links = boundary_links(setting, cluster.network)
    busy = handover_busy(len(layers_per_stage), cluster.network.handover_cpu_s)
    entries = [costs.input_row_bytes] + list(costs.output_row_bytes[:-1])
    piece_entry, piece_once = piece_terms(costs.names, costs.activation_row_bytes, entries)
    stages, start = [], 0
    for s, size in enumerate(layers_per_stage):
        end = start + size
        state = _state(sum(costs.param_bytes[start:end]), sum(costs.grad_bytes[start:end]), setting, cluster,
                       sum(costs.copy_bytes[start:end])).total
        entry = entries[start]
        stages.append(StageCost(
            s, s % setting.pp, start, end, sum(f[start:end]) + busy[s], sum(b[start:end]) + busy[s], sum(w[start:end]),
            point_to_point(costs.output_row_bytes[end - 1] * rows, links[s])
            if s < len(layers_per_stage) - 1 else 0.0, state,
            sum(costs.activation_row_bytes[start:end]) * rows, entry * rows, sum(flush[start:end]),
            (entry + sum(piece_entry[start + 1:end])) * rows,
            max(piece_once[start:end]) * rows if cluster.recompute_by_layer else 0.0,
        ))
        start = end
    return stages


def predict(costs: LayerCosts, setting: Setting, cluster: Cluster, global_batch: int,
            layers_per_stage: Sequence[int], simulate: bool = True) -> Prediction:
    """Step time and memory of one layout; `simulate=False` times the pipeline by the closed form."""
    if sum(layers_per_stage) != costs.num_layers or len(layers_per_stage) != setting.num_chunks:
        raise ConfigError(
            f"layers_per_stage={list(layers_per_stage)} does not cut {costs.num_layers} layers "
            f"into {setting.num_chunks} stages"
        )
    rows = microbatch_rows(global_batch, setting.dp, setting.num_microbatches)
    stages = _stages(costs, setting, cluster, rows, layers_per_stage)
    p, v = setting.pp, setting.num_virtual_stages
    peaks = peak_activations(setting)
    grad_pass = [st.weight_s if schedule_spec(setting.schedule).splits_backward and not setting.recompute
                 else st.backward_s for st in stages]
    flush = [0.0] * p
    for st in stages:
        flush[st.rank] += st.flush_s
    if simulate:
        timed = time_step(
            compile_schedule(setting.schedule, p, setting.num_microbatches, v),
            [st.forward_s for st in stages], [st.backward_s for st in stages],
            [st.weight_s for st in stages], [st.send_s for st in stages[:-1]],
        )
        ends, grad_starts = list(timed.rank_end), list(timed.last_grad_start)
        if setting.batch_weight_grads:  # each rank's batched W after its last action: its last gradient pass
            grad_starts, ends = ends, [e + x for e, x in zip(ends, flush)]
        pipeline, method = max(timed.step_time, *ends), "simulated"
    else:
        pipeline = partition_problem(costs, setting, cluster, global_batch).objective(layers_per_stage)
        if math.isinf(pipeline):  # the layout exceeds memory; time it anyway
            pipeline = _unbounded(costs, setting, cluster, global_batch).objective(layers_per_stage)
        pipeline += handover_term(setting, cluster.network.handover_cpu_s)
        ends = [pipeline] * p
        grad_starts = [pipeline - (flush[r] if setting.batch_weight_grads else
                                   max(grad_pass[s] for s in range(r, setting.num_chunks, p))) for r in range(p)]
        method = "closed form"
    dp, zero = setting.dp, setting.zero
    late = zero == 3 and (schedule_spec(setting.schedule).splits_backward or setting.batch_weight_grads)
    summed, gather, optimizer, states, acts, memory, reach = [], [], [], [], [], [], []
    by_layer: list[int] = []
    by_rank: list[list[StageCost]] = [[] for _ in range(p)]
    for st in stages:
        by_rank[st.rank].append(st)
    grad_sum, param_sum, step_sum, copy_sum = (_prefix(values) for values in (
        costs.grad_bytes, costs.param_bytes, costs.optimizer_s, costs.copy_bytes or [0.0] * costs.num_layers))
    # ZeRO-2 reduces each bucket to its owners: one reduce of 1/dp of it per owner
    # ZeRO-3 reduce-scatters each gradient to the owners of its shards
    gradient_sum = by_owner if zero == 2 and cluster.owner_reduces else reduce_scatter if zero == 3 else all_reduce
    per_node = cluster.network.devices_per_node
    seen: dict[tuple[Any, ...], tuple[float, float, float, StateBytes]] = {}  # ranks alike priced once
    for r in range(p):
        mine = by_rank[r]
        ranges = tuple((st.start, st.end) for st in mine)
        grads = sum(grad_sum[b] - grad_sum[a] for a, b in ranges)
        params = sum(param_sum[b] - param_sum[a] for a, b in ranges)
        copies = sum(copy_sum[b] - copy_sum[a] for a, b in ranges)  # low precision: what zero=3 gathers
        # a rank's replicas are r, r + pp, ...: one node when the first and last share it
        one_node = r // per_node == setting.rank_of(r, dp - 1) // per_node
        layers = tuple(costs.grad_bytes[a:b] for a, b in ranges)
        key = (layers, params, copies, one_node)
        if key not in seen:
            replicas = [setting.rank_of(r, d) for d in range(dp)]
            link = cluster.network.reduce_link(replicas)
            last, count = bucket_summary([x for part in layers for x in part], cluster.bucket_bytes)
            tail = gradient_sum(last, dp, link)
            # ZeRO: each owner broadcasts its updated share (1/dp of the trainable bytes) to the others:
            # copies, no sums, at the point-to-point link's rate (2 gloo ranks: two 16 MiB broadcasts
            # took 10-11 ms, a send and a receive of 16 MiB each way 12-13, a 32 MiB all-reduce 23)
            # ZeRO-3 all-gathers the parameters for each micro-batch's forward and again for its backward
            # (recomputation: a third time, for the forward it repeats)
            gathers = (3 if setting.recompute else 2) * setting.num_microbatches
            shared = (gathers * all_gather(copies or params, dp, link) if zero == 3
                      else by_owner(grads, dp, cluster.network.link(replicas)) if zero else 0.0)
            if offloaded(setting, cluster):  # each gather's shard copied in, the summed gradient's out
                shared += (gathers * (params - copies) / dp + grads / dp) / cluster.host_link
            seen[key] = (summed_in(count, grads, dp, link, gradient_sum), tail, shared,
                         _state(params, grads, setting, cluster, copies))
        total, tail, shared, state = seen[key]
        summed.append(total)
        gather.append(shared)
        stepped = sum(step_sum[b] - step_sum[a] for a, b in ranges)
        if offloaded(setting, cluster) and cluster.host_bandwidth > 0:  # the host steps the shard: reads its
            # value, gradient and state, writes value and state (1 + 1 + k + 1 + k gradient bytes)
            optimizer.append((3 + 2 * cluster.optimizer_state_factor) * grads / dp / cluster.host_bandwidth)
        else:
            optimizer.append(stepped / dp if zero else stepped)
        states.append(state)
        if recomputed_memory(setting):
            forms = [st.recomputed(peaks[r]) for st in mine]
            acts.append(peaks[r] * sum(kept for kept, _, _ in forms) + max(once for _, once, _ in forms))
            by_layer.extend(st.stage_index for st, (_, _, layered) in zip(mine, forms) if layered)
        else:
            acts.append(peaks[r] * hold(setting) * sum(st.activation_bytes for st in mine))
        memory.append(states[r].peak(acts[r]))
        if cluster.overlap_gradients and not late:  # (zero=3, weight gradients late: summed after them)
            reach.append(max(ends[r], grad_starts[r] + summed[r], ends[r] + tail))
        else:
            reach.append(ends[r] + summed[r])
    if riding(setting, cluster):  # each rank steps its optimizer when its own part is done
        closing, step = 0.0, max(r + o + g for r, o, g in zip(reach, optimizer, gather))
    else:
        world = range(setting.pp * dp)
        closing = all_reduce(CLOSING_BYTES, len(world), cluster.network.reduce_link(world))
        step = max(reach) + closing + max(o + g for o, g in zip(optimizer, gather))
    return Prediction(
        tuple(stages), pipeline, tuple(summed), closing, tuple(optimizer), tuple(memory),
        step, method, rows,
        gather_s=tuple(gather), parameter_bytes=tuple(s.parameters for s in states),
        gradient_bytes=tuple(s.gradients for s in states), optimizer_bytes=tuple(s.optimizer for s in states),
        activation_bytes=tuple(acts), recompute_by_layer=tuple(sorted(by_layer)),
    )


def _state(param_bytes: float, grad_bytes: float, setting: Setting, cluster: Cluster,
           copy_bytes: float = 0.0) -> StateBytes:
    return state_bytes(param_bytes, grad_bytes, cluster.optimizer_state_factor, setting.dp, setting.zero, copy_bytes,
                       offloaded(setting, cluster), schedule_spec(setting.schedule).splits_backward)


def offloaded(setting: Setting, cluster: Cluster) -> bool:
    """Whether `setting`'s offload moves anything: on a device beside its host (CPU ranks: no)."""
    return setting.offload and cluster.host_link > 0


def _prefix(values: Sequence[float]) -> list[float]:  # [i] = sum of values[:i]: a range's sum in two lookups
    return [0.0, *itertools.accumulate(float(x) for x in values)]


def _unbounded(costs: LayerCosts, setting: Setting, cluster: Cluster, global_batch: int) -> PartitionProblem:
    unlimited = dataclasses.replace(cluster, memory_bytes=math.inf)
    return partition_problem(costs, setting, unlimited, global_batch)
