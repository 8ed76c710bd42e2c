"""`Pipeline`: the captured model cut into stages, and this rank's share of running it.

Building one is the straight sequence of phases of the data flow, from a captured model and a
complete plan: split into stage modules -> schedule programs -> executors and the interpreter.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from plait.capture.compute_dtype import dtype_of
from plait.capture.output import OutputSpec
from plait.capture.split import StageModule, split, stage_holders, stage_of_layers, tied_named
from plait.capture.tp_layout import TpLayout
from plait.capture.trace import CapturedGraph
from plait.cost.recompute_pieces import pieces
from plait.plan import Plan
from plait.plan.execution import Execution
from plait.runtime.batched_wgrad import WeightBatch, defer_linear_weight_grads
from plait.runtime.comm.collectives import TiedGradients, broadcast_tensors, make_group
from plait.runtime.comm.shared_rings import shared_rings
from plait.runtime.comm.waiting import polls
from plait.runtime.comm.wire import Wire
from plait.runtime.dp.grad_sync import GradientBuckets
from plait.runtime.dp.sharded_params import ShardedParameters
from plait.runtime.dp.zero import ShardedOptimizerState, zero_owners
from plait.runtime.precision.compute_copies import ComputeCopies
from plait.runtime.update.loss_scale import LossScale
from plait.runtime.executor import StageExecutor
from plait.runtime.interpreter import Interpreter
from plait.runtime.memory.activation_meter import ActivationMeter
from plait.runtime.tp.tensor_parallel import shard_stage
from plait.runtime.tp.tp_collectives import same_generators
from plait.runtime.tp.layouts import layouts_data, stage_layouts
from plait.runtime.tp.vocab_loss import SplitLoss
from plait.runtime.tracer import NULL_TRACER, NullTracer, Tracer
from plait.runtime.widths.stage_widths import crossings, lane_ranks, stage_group, tie_groups
from plait.schedule import Program, generate
from plait.schedule.registry import schedule_spec

__all__ = ["Pipeline", "build_pipeline", "stage_tensors"]

log = logging.getLogger("plait")


@dataclass
class Pipeline:
    """Everything one rank needs to run steps of one captured graph (train or eval)."""

    captured: CapturedGraph
    stages: list[StageModule]
    plan: Plan
    rank: int
    executors: dict[int, StageExecutor]  # stage index -> executor, for the stages of this rank
    interpreter: Interpreter
    ties: TiedGradients | None
    local_parameters: list[nn.Parameter]
    owner_of: dict[int, int]  # id(tensor) -> rank that trains it
    output_spec: OutputSpec
    layer_stage: list[int]
    sync: GradientBuckets | None  # data-parallel gradient buckets (dp > 1)
    execution: Execution
    zero: ShardedOptimizerState | None = None  # optimizer state sharded over the replicas (plan.zero)
    meter: ActivationMeter | None = None  # bytes held for backward passes (training pipeline)
    tp_group: Any = None  # this rank's tensor-parallel group (plan.tp > 1)
    tp_parts: dict[int, tuple[int, int, list[int]]] = field(default_factory=dict)  # id(tensor) -> dim, blocks, ranks
    copies: ComputeCopies | None = None  # the low-precision copies the stages compute with (plan.precision)
    loss_scale: LossScale | None = None  # fp16's dynamic loss scale (training pipeline)
    sharded: ShardedParameters | None = None  # zero=3: the stages' parameters sharded over their replicas
    _programs: dict[tuple[int, bool], Program] = field(default_factory=dict)

    def start_equal(self) -> None:
        """Make this rank's stage tensors equal to its stage's first replica's, and each tied
        parameter equal to its first holder's: a real model whose ranks drew different values
        starts consistent, each tensor sent only within the group that holds it."""
        tied = {id(p) for p in self.ties.parameters} if self.ties is not None else set()
        if self.sync is not None:
            first = self.plan.mesh.dp_ranks(self.rank)[0]  # this rank's place on the first replica
            buffers = {id(b): b for s in self.executors for b in self.stages[s].module.buffers()}
            own = [p for p in self.local_parameters if id(p) not in tied] + list(buffers.values())
            broadcast_tensors(own, first, self.sync.group)
        if self.ties is not None:
            self.ties.broadcast()

    def whole_parameters(self) -> contextlib.AbstractContextManager[None]:
        """With zero=3, the user's parameters filled with their whole values for the time of the
        `with` block (an all-gather over each stage's replicas); else nothing to do."""
        if self.sharded is None:
            return contextlib.nullcontext()
        return self.sharded.gathered(self.copies.release if self.copies is not None else None)

    def shard_parts(self) -> dict[int, tuple[int, int, list[int]]]:
        """zero=3: id(parameter) -> (dim 0, one block, its replicas' ranks) of every stage's parameters
        FSDP2 shards (one tied across stages stays whole), as a checkpoint's index splits them."""
        if self.sharded is None:
            return {}
        holders, _ = stage_holders(self.stages)
        params = {id(p) for st in self.stages for p in st.module.parameters()}
        return {i: (0, 1, [self.plan.rank_of(ss[0], r) for r in range(self.plan.dp)])
                for i, ss in holders.items() if i in params and len(ss) == 1}

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the model's last stage (it computes the loss)."""
        return self.plan.num_chunks - 1 in self.executors

    @property
    def last_executor(self) -> StageExecutor:
        return self.executors[self.plan.num_chunks - 1]

    @property
    def tp_rank(self) -> int:
        return self.plan.tp_rank_of(self.rank)

    @property
    def replica(self) -> int:
        return self.plan.position_of(self.rank)[1]

    def program(self, num_microbatches: int, train: bool) -> Program:
        """This step's per-rank programs (generated and validated once per micro-batch count)."""
        key = (num_microbatches, train)
        if key not in self._programs:
            self._programs[key] = generate(
                self.plan.schedule, self.plan.num_chunks, num_microbatches,
                forward_only=not train, stage_to_rank=dict(enumerate(self.interpreter.stage_to_rank)),
                num_virtual_stages=self.plan.num_virtual_stages,
            )
        return self._programs[key]

    def for_eval(self, captured: CapturedGraph, loss: Callable[[Any, Any], torch.Tensor] | None) -> "Pipeline":
        """The same split for evaluation on `captured`, the model captured in eval mode (every
        tracer bakes the mode into the graph): each layer goes to the stage its name had in
        training, and every parameter and buffer is read on a stage that holds it in training
        (the rank that trained it; the others may have freed it), sent on to the stages after
        where the eval graph reads it elsewhere (`plait.capture.split`)."""
        by_name = dict(zip(self.plan.layer_names, self.layer_stage))
        layer_stage, current = [], 0
        for name in captured.layers.layer_names:  # layers missing in train mode join their predecessor
            current = by_name.get(name, current)
            layer_stage.append(current)
        parts = _Parts(self.plan, self.rank, loss, self.execution, self.interpreter.wire,
                       self.interpreter.tracer, self.output_spec, self.tp_group, self.copies)
        held_by, _ = stage_holders(self.stages)
        with self.whole_parameters():  # zero=3 below fp32: the evaluation copies made from the whole values
            made = _assemble(captured, layer_stage, parts, make_ties=False, held_by=held_by)
        made.sharded = self.sharded  # zero=3: evaluation runs on the whole values, gathered per batch
        return made

    def gather_outputs(self, leaves: list[Any] | None, shard_rows: Sequence[int], key: Any) -> list[list[Any]]:
        """Every replica's last-stage output leaves, on every rank, in replica order.

        The last stage of each replica with rows sends its leaves to every other rank (isend,
        described once per peer); replicas without rows send nothing.
        """
        plan, wire = self.plan, self.interpreter.wire
        last = plan.num_chunks - 1
        if plan.world_size == 1:
            assert leaves is not None
            return [leaves]
        tag = 1 << 20
        for r, rows in enumerate(shard_rows):
            if rows and plan.rank_of(last, r, 0) == self.rank:
                assert leaves is not None
                for peer in range(plan.world_size):
                    if peer != self.rank:
                        wire.send(list(leaves), peer, (key, r), tag + r)
        out = []
        for r, rows in enumerate(shard_rows):
            if not rows:
                continue
            src = plan.rank_of(last, r, 0)
            if src == self.rank:
                assert leaves is not None
                out.append(leaves)
            else:
                out.append(wire.recv(src, (key, r), tag + r)[0])
        wire.drain()
        return out


def stage_tensors(captured: CapturedGraph, plan: Plan, rank: int | None) -> list[torch.Tensor]:
    """The parameters and buffers the stages of `rank` use (None: of every stage): what a meta model
    materializes there, and what a real model's rank keeps."""
    stages = split(captured, stage_of_layers(plan.layers_per_stage))
    chosen = range(plan.num_chunks) if rank is None else plan.stages_of(rank)
    return [t for s in chosen for t in (*stages[s].module.parameters(), *stages[s].module.buffers())]


def build_pipeline(net: nn.Module, captured: CapturedGraph, plan: Plan, execution: Execution, rank: int,
                   loss: Callable[[Any, Any], torch.Tensor] | None, device: torch.device,
                   first: bool = False, fill: Callable[[list[nn.Parameter]], object] | None = None) -> Pipeline:
    """This rank's share of running `plan` on the captured model: its stage modules, executors,
    interpreter, gradient buckets and tied-parameter sums (`net` owns the parameters).

    The plan is complete (`plait.planner.resolve`: its tp layouts chosen there): nothing is decided
    here. The `first` build of a real model with tp > 1 takes its stages' values from the tp group's
    first rank before they are cut (ranks that drew different values cut parts of one model).
    `fill`: zero=3 on a meta model, gives a layer's parameters their values just before they are
    sharded (`plait.materialize.Deferred.fill`).
    """
    assert captured.output_spec is not None, "capture with capture_batch: the pipeline rebuilds outputs"
    tracer: Tracer | NullTracer = NULL_TRACER
    if execution.trace_dir is not None:
        tracer = Tracer(rank, {
            "schedule": plan.schedule, "num_stages": plan.num_stages, "num_chunks": plan.num_chunks, "pp": plan.pp,
            "num_virtual_stages": plan.num_virtual_stages, "dp": plan.dp, "tp": plan.tp,
            "stage_tp": list(plan.stage_tp), "stage_dp": list(plan.stage_dp),
            "world_size": plan.world_size, "num_microbatches": plan.num_microbatches,
            "stage_to_rank": list(plan.stage_to_rank), "recompute": list(plan.recompute),
        })
    copies = ComputeCopies(dtype_of(plan.precision)) if plan.precision != "fp32" else None
    wire = Wire(execution.timeout_s, device, rings=shared_rings(device, execution.timeout_s, polls()))
    parts = _Parts(plan, rank, loss, execution, wire, tracer, captured.output_spec,
                   _tp_group(plan, rank), copies, device, fill)
    return _assemble(captured, stage_of_layers(plan.layers_per_stage), parts, make_ties=True, equal_tp=first)


@dataclass(frozen=True)
class _Parts:
    """What the training and the evaluation pipeline of one model share on this rank."""

    plan: Plan
    rank: int
    loss: Callable[[Any, Any], torch.Tensor] | None
    execution: Execution
    wire: Wire
    tracer: Tracer | NullTracer
    output_spec: OutputSpec
    tp_group: Any = None  # this rank's tensor-parallel group (plan.tp > 1)
    copies: ComputeCopies | None = None  # plan.precision below fp32: the copies of this rank's parameters
    device: torch.device = torch.device("cpu")
    fill: Callable[[list[nn.Parameter]], object] | None = None  # zero=3 on meta: a layer's values, as it is sharded


def _assemble(captured: CapturedGraph, layer_stage: list[int], parts: _Parts, make_ties: bool,
              equal_tp: bool = False, held_by: dict[int, list[int]] | None = None) -> Pipeline:
    """Split `captured` by `layer_stage` and make this rank's executors and interpreter; the
    training pipeline (`make_ties`) also gets its tied-parameter sums and gradient buckets, and
    its tp ranks the same generator states (`equal_tp`: the same values too, before the cut).
    `held_by`: the training stages of each tensor, where they are read (`split`)."""
    plan, rank = parts.plan, parts.rank
    stages = split(captured, layer_stage, held_by)
    t = plan.tp_rank_of(rank)
    layouts: dict[int, TpLayout] = {}
    split_loss = None
    if plan.tp > 1:  # every stage's layout as the plan chose it (data of these graphs), this rank's stages cut
        layouts = stage_layouts(stages, plan)
        plan = replace(plan, tp_layouts=layouts_data(stages, layouts))  # before the cut
    if plan.tp_of(plan.position_of(rank)[0]) > 1:  # this rank's stage is split
        first = plan.mesh.tp_ranks(rank)[0]  # the tp group's first rank
        if equal_tp:
            held = {id(x): x for s in plan.stages_of(rank) for x in [*stages[s].module.parameters(),
                                                                    *stages[s].module.buffers()]}
            broadcast_tensors(list(held.values()), first, parts.tp_group)
        if make_ties:  # dropout in the regions every tp rank computes whole draws the same masks
            same_generators(first, parts.tp_group)
        for s in plan.stages_of(rank):  # the training pipeline's last stage keeps its logits split
            keep = make_ties and s == plan.num_chunks - 1 and parts.loss is not None
            left = shard_stage(stages[s].module, layouts[s], t, parts.tp_group, gather_outputs=not keep,
                               low_precision=plan.precision != "fp32")
            if left and parts.loss is not None:
                split_loss = SplitLoss(captured.finish, parts.loss, left, parts.tp_group, t, plan.tp_of(s))
    holders, _ = stage_holders(stages)
    owners = _zero_owners(stages, plan, holders)
    owner_of = {i: plan.rank_of(min(s), owners.get(i, 0)) for i, s in holders.items()}  # tp rank 0
    tp_parts: dict[int, tuple[int, int, list[int]]] = {}  # id(parameter) -> dim, blocks, the rank of each part
    for s, lay in layouts.items():
        for target, (dim, blocks) in lay.params.items():
            i = id(stages[s].module.get_parameter(target))
            tp_parts.setdefault(i, (dim, blocks, list(plan.mesh.stage_ranks(min(holders[i]), owners.get(i, 0)))))
    mine = plan.stages_of(rank)
    local = list({id(p): p for s in mine for p in stages[s].module.parameters()}.values())
    # what the executors run: the stages, or their copies computing in plan.precision (made before the buckets
    # listen); zero=3 training copies only the parameters tied across stages (FSDP2 casts the sharded ones)
    only = {id(p) for p, _ in tied_named(captured.root, plan.tied_parameters)} if make_ties and plan.zero == 3 else None
    computed = {s: parts.copies.stage(stages[s], only) if parts.copies is not None else stages[s] for s in mine}
    ties, sync, zero, params = None, None, None, None
    batches: dict[int, WeightBatch | None] = {}
    if make_ties:
        replicas = list(plan.mesh.dp_ranks(rank))  # this rank's place on each replica of its stage
        sharded = {id(p): owners[id(p)] for p in local if id(p) in owners}  # this rank's stage's
        owner_rank = {i: replicas[r] for i, r in sharded.items()} if plan.zero == 2 else None
        ties, sync, group = _ties_and_buckets(captured, parts, local, owner_rank, buckets=plan.zero != 3)
        if sharded:
            assert sync is not None
            zero = ShardedOptimizerState([p for p in local if id(p) in sharded], sharded, replicas, rank,
                                         sync.group)
        if plan.zero == 3 and group is not None:
            tied = {id(p) for p in ties.parameters} if ties is not None else set()  # stay whole, summed by `ties`
            if parts.copies is not None:  # and their low copies
                tied |= parts.copies.copy_ids
            if plan.batch_weight_grads:  # the linears rewritten before FSDP2 takes the pieces (it owns their code after)
                batches = {s: defer_linear_weight_grads(computed[s].module) for s in mine}
            params = _sharded(computed, parts, group, tied, local, replicas[0], equal_tp)
            computed = {s: params.stages[s] for s in mine}
            local = params.parameters + [p for p in local if id(p) in tied]
    meter = ActivationMeter() if make_ties else None
    executors = {
        s: StageExecutor(computed[s], captured.finish, parts.loss, recompute=s in plan.recompute,
                         batch_weight_grads=plan.batch_weight_grads, meter=meter,
                         split_loss=split_loss if s == plan.num_chunks - 1 else None,
                         layer_pieces=pieces(plan.layer_names) if s in plan.recompute_by_layer else None,
                         copies=parts.copies,
                         sharded=params, weight_batch=batches.get(s),
                         compile_backend=parts.execution.compile_backend)
        for s in mine
    }
    interpreter = Interpreter(rank, executors, lane_ranks(plan, rank), parts.wire, parts.tracer,
                              crossings(plan, rank, parts.tp_group, stages) if plan.stage_tp or plan.stage_dp
                              else None)
    return Pipeline(captured, stages, plan, rank, executors, interpreter, ties, local, owner_of,
                    parts.output_spec, layer_stage, sync, parts.execution, zero, meter, tp_group=parts.tp_group,
                    tp_parts=tp_parts, copies=parts.copies,
                    loss_scale=LossScale() if make_ties and plan.precision == "fp16" else None, sharded=params)


def _sharded(computed: dict[int, StageModule], parts: _Parts, group: Any, tied: set[int],
             local: list[nn.Parameter], first: int, equal: bool) -> ShardedParameters:
    """zero=3: this rank's stages with their parameters sharded over the replicas (`group`), a first
    build's values taken from the first replica before they are cut; the parameters in `tied` (ids:
    tied across stages) stay whole. The user's parameters are freed as each piece is sharded."""
    if equal:  # the replicas start equal (`Pipeline.start_equal` has no buckets' group to do it with)
        buffers = {id(b): b for st in computed.values() for b in st.module.buffers()}
        broadcast_tensors([p for p in local if id(p) not in tied] + list(buffers.values()), first, group)
    offload = parts.plan.offload
    if offload and parts.device.type == "cpu" and parts.rank == 0:
        log.info("plait: offload changes nothing on CPU ranks: the optimizer state is in host memory already")
    params = ShardedParameters(group, parts.device, dtype_of(parts.plan.precision),
                               dtype_of(parts.execution.reduce_precision), offload=offload and parts.device.type != "cpu",
                               fill=parts.fill, split_backward=schedule_spec(parts.plan.schedule).splits_backward,
                               batched=parts.plan.batch_weight_grads)
    for s, st in computed.items():
        params.stage(s, st, pieces(parts.plan.layer_names), tied)  # each piece's wholes freed once sharded
    return params


def _tp_group(plan: Plan, rank: int) -> Any:
    """This rank's tensor-parallel group, None on a stage of one rank (every rank makes every group
    of `Mesh.tp_groups`, in its order)."""
    return stage_group(plan, rank)


def _zero_owners(stages: Sequence[StageModule], plan: Plan, holders: dict[int, list[int]]) -> dict[int, int]:
    """With plan.zero 1 or 2: id(parameter) -> the replica that steps it, for the trainable parameters
    of every pipeline position that no other stage holds (a tied parameter is not sharded)."""
    if plan.zero not in (1, 2):
        return {}
    positions: list[dict[int, nn.Parameter]] = [{} for _ in range(plan.pp)]
    for st in stages:
        for p in st.module.parameters():
            position = plan.mesh.position_of_stage(st.stage_index)
            if p.requires_grad and len(holders[id(p)]) == 1 and plan.dp_of(position) > 1:
                positions[position].setdefault(id(p), p)
    owners: dict[int, int] = {}
    for position, params in enumerate(positions):  # stage_dp: each over its own replicas
        owners.update(zero_owners([list(params.values())], plan.dp_of(position)))
    return owners


def _ties_and_buckets(captured: CapturedGraph, parts: _Parts, local: list[nn.Parameter],
                      owner_rank: dict[int, int] | None,
                      buckets: bool = True) -> tuple[TiedGradients | None, GradientBuckets | None, Any]:
    """The gradient sums of the plan's tied parameters, the data-parallel buckets (ZeRO-2,
    `owner_rank`: each parameter's gradient reduced to the rank that steps it; none without
    `buckets`: zero=3 reduce-scatters its own) and this rank's data-parallel group."""
    plan, rank, execution = parts.plan, parts.rank, parts.execution
    tied = tied_named(captured.root, plan.tied_parameters)  # as the planner found them (`complete_plan`)
    ties = None
    if plan.world_size > 1:
        # One all-reduce over every stage and every replica holding a tied parameter
        # sums both the tie (layer reuse) and the data-parallel contributions.
        ties = TiedGradients([(p, ranks, silent) for p, ss in tied for ranks, silent in tie_groups(plan, ss)], rank)
    sync, group = None, None
    if plan.mesh.dp_groups():
        # every rank makes every group, in the mesh's order (stage_dp: the stages of several replicas)
        groups = {ranks: make_group(ranks) for ranks in plan.mesh.dp_groups()}
        group = groups.get(plan.mesh.dp_ranks(rank))
        tied_ids = {id(p) for p, _ in tied}
        bucketed = [p for p in local if id(p) not in tied_ids]
        if owner_rank is not None:  # a frozen parameter has no owner: its (zero) gradient goes to the first
            first = plan.mesh.dp_ranks(rank)[0]
            owner_rank = {id(p): owner_rank.get(id(p), first) for p in bucketed}
        if group is not None and buckets:
            after = parts.copies.after_grad if parts.copies is not None else None
            reduce = dtype_of(execution.reduce_precision) if execution.reduce_precision != "fp32" else None
            sync = GradientBuckets(bucketed, group, execution.bucket_bytes, execution.timeout_s, owner_rank,
                                   rank, after, reduce)
    return ties, sync, group
