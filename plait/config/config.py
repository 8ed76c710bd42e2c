"""The user's `Config`: a frozen dataclass checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from plait.config.aliases import taking_old_names
from plait.config.json_form import config_from_dict, config_from_json, config_to_dict, config_to_json
from plait.config.layout import check_layout, check_recompute, check_schedule, check_tp, check_zero
from plait.config.settings import (check_checkpoints, check_compile, check_init_fn, check_leaf_modules,
                                   check_planning, check_precision, check_running)
from plait.config.widths import check_stage_dp, check_stage_tp
from plait.plan.execution import Execution
from plait.plan.mesh import Mesh

__all__ = ["Config", "UNPLANNED"]

#: What a layout field left open (None) takes where nothing plans it (`Config.with_defaults`).
UNPLANNED: dict[str, Any] = {"dp": 1, "num_microbatches": 1, "tp": 1, "schedule": "1f1b", "recompute": False,
             "batch_weight_grads": False}


@taking_old_names
@dataclass(frozen=True)
class Config:
    """How to split and run the model.

    What is left open is planned when the model first sees data (`plait.planner.layout`): with no
    size at all (none of layers_per_stage, split_points, num_stages, dp, num_microbatches, plan)
    rank 0 profiles the model and the cost model chooses pp, dp, micro-batches, schedule and
    recomputation (the search honours a schedule or recompute given); with a size but no cut
    (layers_per_stage or split_points), the layers are cut by the cost model's optimal partition
    for that layout.
    Every rank gets rank 0's choice. One process (no launcher) runs one stage, unplanned.

    The layout's fields have the Plan's names (layers_per_stage, stage_tp, stage_dp); the old ones
    (layers_per_proc, tp_per_stage, dp_per_stage) still work, made and read (`plait.config.aliases`).

    layers_per_stage: captured layers on each pipeline stage, in order (None: planned).
        With num_virtual_stages = v > 1 it lists every model chunk, num_stages x v entries.
    split_points: the cut given by module names instead of counts (None: planned): qualified
        names as in `net.named_modules()` (e.g. ["model.layers.6"] or ["transformer.h.2"]), each
        starting a new stage at the first captured layer that runs in that module, in the
        model's order: len + 1 stages (with v > 1, len + 1 = num_stages x v chunks). Like
        torch.distributed.pipelining's SplitPoint.BEGINNING. Not with layers_per_stage or plan.
    leaf_modules: modules to keep whole, not traced into (one opaque layer each, its own forward
        run as it is): qualified names as in `net.named_modules()`, or class names (or classes)
        for every instance. plait keeps a module whole by itself where torch.export stops in it.
    zero: 1 shards each stage's optimizer state over its dp replicas (ZeRO stage 1: each replica
        steps its share of the parameters, whole ones, then broadcasts them); 2 also shards the
        gradients (each bucket reduced to the owners of its parameters instead of all-reduced,
        and the others' gradients freed before the optimizer step); 3 also shards the parameters
        (ZeRO-3, by torch's FSDP2 `fully_shard` on each layer of a stage: gathered for a layer's
        forward and backward, gradients reduce-scattered in the last micro-batch's backward;
        `plait.runtime.dp.sharded_params`; below fp32 FSDP2 gathers the masters' low copies and
        sums the gradients in reduce_precision; checkpoints hold each replica's rows of the
        parameters and their state, and load into any layout; with recomputation, several chunks
        a rank, and a given tp too: each rank's tp part sharded over its replicas, checkpointed
        as tp parts; with a split backward (ZB-H1) or batched weight gradients every gradient is
        reduce-scattered once the step's last ones are in; a load reads each replica's rows only)
        -- without stage widths or replan yet (refused by name); 0 replicates all. None (default):
        the planner chooses the lowest level that fits, else 0. Needs dp > 1 (or a stage_dp of a
        stage > 1).
    init_fn: for a model built on the meta device, fn(module) initialising one module's own
        tensors in place (None: a Hugging Face model's `_init_weights`, else each module's
        `reset_parameters()`), called under an RNG seeded by (seed, module name) so values do not
        depend on the layout (`plait.materialize`). A function: `to_dict` leaves it out.
    num_stages: pipeline stages, i.e. ranks per pipeline (None: the length of `layers_per_stage`
        or of `split_points` + 1, divided by v, else the world size / dp, or planned when no
        size is given).
    num_microbatches: micro-batches each global batch is cut into (clamped to the batch size;
        None: 1, or planned when no size is given).
    schedule: "gpipe", "1f1b", "interleaved" (Megatron's interleaved 1F1B: each rank holds
        num_virtual_stages non-adjacent model chunks) or "zbh1" (zero bubble ZB-H1: the backward
        split into input gradients, sent at once, and weight gradients, run in the bubbles).
        None: "1f1b", or planned when no size is given.
    num_virtual_stages: model chunks per rank for schedule="interleaved" (1 otherwise).
    recompute: activation recomputation: True (every stage), False, "auto" (the stages that
        hold activations of more than one micro-batch at once under the schedule, where it
        saves memory) or a list of stage indices. A recomputed stage keeps only its inputs and
        runs its forward again during the backward. None: False, or planned when no size is given.
    recompute_by_layer: how recomputed stages recompute: True, each layer (a repeated block, e.g.
        a transformer layer) under its own checkpoint -- every layer's input kept, one layer's
        activations alive at a time (Megatron-LM's full recomputation); False, the stage whole
        -- its input kept, all its activations alive while it is recomputed; or a list of stage
        indices. None: per stage, whichever the planner prices smaller where it plans, else False.
    plan: a plan file to replay instead of planning: the JSON of `model.plan_report.save()` or
        `plait plan -o` (the layout, micro-batches, schedule and recomputation it chose), or
        of `model.plan.to_json()`. Its world size and layers must match this run.
    memory_limit_bytes: bytes of parameters, gradients, optimizer state and activations one
        rank may hold, for planning (None: 90% of this machine's RAM shared by its local ranks).
        With tp > 1 it drives the tp search: linears cheaper whole stay whole while the state fits.
    replan: after the first training steps plait compares each stage's measured time with the
        plan's prediction (a log line and `model.plan_report.feedback`); with replan=True, when
        a stage or the step is off by more than 15%, rank 0 re-partitions the layers with costs
        corrected by the measurements and the run goes on in the new layout (parameters and
        optimizer state carried over exactly, through a checkpoint in checkpoint_dir, or in a
        temporary directory, which must then be on a file system every rank sees). None (the
        default): as `plait run --replan` says (`plait.config.run_options`), else False.
    batch_weight_grads: linear layers compute their weight gradients once per step over all
        micro-batches (one GEMM over every row instead of one per micro-batch; see
        plait/runtime/batched_wgrad.py). Faster where small GEMMs are slow (CPUs); keeps each linear's
        inputs and output gradients to the step's end. In bf16 or fp16 the step's weight gradients are
        computed in fp32 from the low-precision operands and added into the fp32 master gradients
        (Megatron's gradient-accumulation fusion). None: the planner's choice (else False).
    trace_dir: write each rank's measured timeline there as Chrome trace JSON (None: no trace).
    seed: seeds the shuffle order, identical on every rank.
    timeout_s: longest any wait on another rank may take before the run fails with a report.
    dp: data-parallel replicas of the pipeline; world size = dp x num_stages x tp.
    tp: tensor-parallel ranks per stage (Megatron-LM's layout, found on the captured graph: linear
        pairs column- then row-parallel, attention by heads, the word embedding and the LM head
        by vocabulary rows); tp ranks are consecutive (one node). Default None: the planner chooses
        it (1, 2, 4 or 8 within a node) where it plans the whole layout by timing, else 1.
    stage_tp: one tp per pipeline stage, for stages of different widths (Alpa's cross-mesh
        resharding), e.g. (2, 1) with layers_per_stage=(a, b): stage 0 on ranks 0 1, stage 1 on rank 2
        (the stages' ranks in order; world size = their sum x dp: with dp=2, a second copy of the
        pipeline on ranks 3 4 | 5, each stage's gradients all-reduced over the copies, and ZeRO
        sharding over them). A stage output crosses as `crossing` says (`plait.cost.tiles`). Needs
        the cut (layers_per_stage or split_points); not with interleaving, tp_plan, sequence
        parallelism, a plan file or replan (refused by name). Checkpoints and exports are by name,
        as for any layout: they load into any other, and any other's into these. None: one tp for
        every stage (`tp`).
    crossing: with stage_tp, how a value crosses between stages of different widths: "tiles"
        (once over the link, tile by tile; the receiving stage all-gathers it, Alpa's) or "whole"
        (every receiving rank gets all of it; nothing gathered). None: "tiles", or the planner's
        choice by its cost model where it chose the widths.
    stage_dp: one dp per pipeline stage, for stages of different data-parallel widths, e.g.
        (2, 1) with layers_per_stage=(a, b): stage 0 on ranks 0 1 (two replicas, each running half
        the rows of every micro-batch), stage 1 on rank 2 (world size = their sum). Activations cross
        by row blocks and their gradients back (`plait.cost.row_blocks`); each micro-batch's rows
        must divide by every stage's dp. Needs the cut and tp=1; not with grad_reduction="sum" nor
        what stage_tp refuses but ZeRO (refused by name); with zero, each stage of replicas
        shards its optimizer state (2: and gradients) over them. None: one dp for every stage.
    tp_plan: {module-name pattern: "colwise" | "rowwise" | "vocab" | "replicate"} fixing the
        strategy of the linears and embeddings it names (fnmatch patterns such as
        "*.mlp.c_fc"; the first matching pattern wins); the rest is found automatically.
    sequence_parallel: with tp > 1, Megatron's sequence parallelism: row-parallel sums are
        reduce-scattered over the tokens, so norms, dropouts and residual adds run on 1/tp of them.
    grad_reduction: "mean" -- gradients of the global batch's mean loss, exactly what one process
        computes, even when the batch does not divide by dp -- or "sum": the sum over replicas of
        each replica's own mean-loss gradients.
    bucket_cap_mb: size of the gradient buckets all-reduced across replicas.
    checkpoint_dir: where `fit` saves checkpoints, and resumes from the latest one it finds
        there (None: no checkpoints). Every rank must see the same directory.
    checkpoint_every: training steps between checkpoints (None: at the end of every epoch).
    checkpoint_keep: complete checkpoints kept; older ones are deleted after a new one is complete.
    on_nonfinite: what a NaN or infinite loss or stage output in a training step does: "stop"
        (raise NonFiniteError naming the step and the first stage where it appeared, on every
        rank, before the optimizer step), "skip" (no optimizer step for that batch, on every
        rank) or "ignore" (no check at all).
    precision: the dtype the stages compute in: "fp32" (default) or "bf16" -- as FSDP2's
        MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): each stage computes
        with a bf16 copy of its parameters (its activations, and what crosses between stages, in
        bf16), floating inputs are cast to bf16 and the model's floating outputs to fp32 before
        the loss; each micro-batch's gradients are added into fp32 gradients of the fp32 master
        parameters (the model's own), which the data-parallel sum, the optimizer, checkpoints
        and state_dict() use; the copies are refreshed from them before every step. "fp16": the
        same in fp16, with dynamic loss scaling as torch.amp.GradScaler's defaults (initial scale
        2**16, halved when a gradient on any rank overflows -- every rank then skips that step --
        doubled after 2000 good steps; kept in checkpoints; `model.loss_scale`). With tp > 1 a
        product whose sum the tp ranks split (a row-parallel linear's output, a column-parallel
        one's input gradient) is computed and all-reduced in fp32 and rounded once, as one process's
        product accumulates in fp32 and rounds once (its bytes priced so); with sequence_parallel
        the reduce-scatters too, and a weight broadcast over the split tokens (a bias, RMSNorm's)
        has its gradient summed over them in fp32 (a layer norm's kernel rounds its own sums: each
        rank's part is rounded).
    reduce_precision: the dtype the data-parallel gradient sums run in: "fp32" (default, FSDP2's
        reduce_dtype=float32) or "bf16" (half the bytes; each bucket rounded to bf16, summed, and
        the sum written back into the fp32 gradients).
    offload: "optimizer" keeps the optimizer state and the fp32 master weights in host memory and
        steps them there when the ranks compute on GPUs (DeepSpeed's ZeRO-Offload), with zero=3
        by FSDP2's CPUOffloadPolicy: each replica's shards live in host memory, a layer's are
        gathered to the GPU for its forward and backward, its gradients reduce-scattered and
        moved to host memory. Needs zero=3. On CPU ranks a no-op (said once). False: never. None
        (default): the planner's, taken only where nothing fits the device without it (ranks on
        GPUs, priced by their host link and host memory bandwidth; `Plan.offload` says).
    clip_grad_norm: clip the global gradient norm to this value before each optimizer step, as
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm) does in one process: the
        norm of the whole model's gradient, each element counted once (over stages, tp shards,
        replicas, ZeRO-2 shards and tied parameters). `model.grad_norm` and fit's batch logs
        ("grad_norm") give the last step's norm before clipping. None (default): no clipping.
    accumulate_steps: k > 1 sums the gradients of k global batches (each loss divided by k) before
        one optimizer step, as one process calling backward on k batches then step() does: the
        data-parallel sums run once, at the k-th batch; a learning-rate schedule steps once per k.
        `model.step` still counts batches; a checkpoint is taken at a multiple of k only
        (checkpoint_every must be one); not with replan=True.
    compile: run each stage's graph (forward and backward) through torch.compile: True (its default
        backend, inductor) or a backend's name ("aot_eager", ...), compiled at a stage's first
        micro-batch (again, for any shape, where a shape changes: torch.compile's default). Equal to
        eager within the rounding of fused kernels. A split
        backward (zbh1) then computes its W with its B (a compiled backward is one call); tp's
        collectives run between compiled graphs; not with zero=3 or batch_weight_grads=True (the
        planner leaves both out). False (default): eager.
    """

    layers_per_stage: tuple[int, ...] | None = None
    split_points: tuple[str, ...] | None = None
    leaf_modules: tuple[str, ...] = ()
    zero: int | None = None
    init_fn: Callable[[Any], None] | None = None  # fn(module), see the docstring
    num_stages: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    num_virtual_stages: int = 1
    recompute: bool | str | tuple[int, ...] | None = None
    trace_dir: str | None = None
    seed: int = 0
    timeout_s: float = 300.0
    dp: int | None = None
    grad_reduction: str = "mean"
    bucket_cap_mb: float = 25.0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int = 2
    on_nonfinite: str = "stop"
    plan: str | None = None
    memory_limit_bytes: float | None = None
    replan: bool | None = None
    batch_weight_grads: bool | None = None
    tp: int | None = None
    tp_plan: tuple[tuple[str, str], ...] | None = None  # given as a dict; kept as its items, in order
    sequence_parallel: bool = False
    stage_tp: tuple[int, ...] | None = None
    crossing: str | None = None
    stage_dp: tuple[int, ...] | None = None
    recompute_by_layer: bool | tuple[int, ...] | None = None
    precision: str = "fp32"
    clip_grad_norm: float | None = None
    accumulate_steps: int = 1
    reduce_precision: str = "fp32"
    offload: str | bool | None = None
    compile: bool | str = False

    def __post_init__(self) -> None:
        # the checks, in this order (a later one reads fields an earlier one normalised): the layout's
        # in plait/config/layout.py and widths.py, the settings beside it in plait/config/settings.py
        check_tp(self)
        check_stage_tp(self)
        check_stage_dp(self)
        check_leaf_modules(self)
        check_layout(self)
        check_zero(self)
        check_init_fn(self)
        check_schedule(self)
        check_recompute(self)
        check_running(self)
        check_checkpoints(self)
        check_planning(self)
        check_precision(self)
        check_compile(self)

    # the old names, read (`Config(layers_per_proc=...)` sets the new field: `taking_old_names`)
    @property
    def layers_per_proc(self) -> tuple[int, ...] | None:
        """`layers_per_stage`'s old name."""
        return self.layers_per_stage

    @property
    def tp_per_stage(self) -> tuple[int, ...] | None:
        """`stage_tp`'s old name."""
        return self.stage_tp

    @property
    def dp_per_stage(self) -> tuple[int, ...] | None:
        """`stage_dp`'s old name."""
        return self.stage_dp

    @property
    def plans_everything(self) -> bool:
        """No size given (layers_per_stage, split_points, num_stages, dp, num_microbatches, plan):
        the planner chooses the whole layout."""
        return (self.layers_per_stage is None and self.split_points is None and self.num_stages is None
                and self.dp is None and self.num_microbatches is None and self.plan is None)

    def with_defaults(self) -> "Config":
        """This config with every field left open set to its unplanned default (dp 1,
        1 micro-batch, "1f1b", no recomputation, weight gradients per micro-batch)."""
        return replace(self, **{name: value for name, value in UNPLANNED.items() if getattr(self, name) is None},
                       tp_plan=self.tp_plan if self.tp else None)

    def execution(self) -> Execution:
        """The runtime's settings beside the plan (the runtime reads these, not the Config)."""
        return Execution(timeout_s=float(self.timeout_s), trace_dir=self.trace_dir, on_nonfinite=self.on_nonfinite,
                         grad_reduction=self.grad_reduction, bucket_bytes=int(self.bucket_cap_mb * 2**20),
                         memory_limit_bytes=self.memory_limit_bytes, clip_grad_norm=self.clip_grad_norm,
                         accumulate_steps=self.accumulate_steps, reduce_precision=self.reduce_precision,
                         compile_backend=("inductor" if self.compile is True else self.compile or None))

    def lanes(self, world_size: int) -> int:
        """Ranks per tensor-parallel part (world size / tp): the pp x dp ranks the layout is planned on
        (tp=None: the world, until the planner chooses tp); the Mesh solves it."""
        lanes = Mesh.widths_lanes(world_size, self.stage_tp, self.stage_dp, self.dp or 1)  # stages of different widths
        if lanes is not None:
            return lanes
        return Mesh.lanes_of(world_size, self.tp, self.num_stages, self.dp)

    def stages_for(self, world_size: int) -> int:
        """Pipeline stages (ranks per pipeline) on `world_size` ranks (world / tp); world size must be
        dp x stages (the Mesh checks it)."""
        stages = Mesh.stages_of_cut(self.layers_per_stage, self.split_points, self.num_stages, self.num_virtual_stages)
        cut = (f"layers_per_stage={None if self.layers_per_stage is None else list(self.layers_per_stage)}"
               if self.split_points is None else f"split_points={list(self.split_points)}")
        return Mesh.pp_of(world_size, self.dp or 1, stages, self.tp or 1, f"{cut}, num_stages={self.num_stages}, ")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-ready values (`plait.config.json_form`)."""
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "Config":
        """The Config of `to_dict()` output (unknown names are an error; missing ones default)."""
        made: Config = config_from_dict(cls, data)
        return made

    def to_json(self) -> str:
        """The fields as a JSON object."""
        return config_to_json(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Config":
        """The Config of `to_json()` output; anything else raises ConfigError."""
        made: Config = config_from_json(cls, text)
        return made
