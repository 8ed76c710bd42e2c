"""The user's `Config`: a frozen dataclass checked when it is made."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable

from plait.capture.tp_layout import TP_PLACEMENT, TP_STRATEGIES
from plait.config.widths import check_dp_per_stage, check_tp_per_stage, stage_lanes
from plait.errors import ConfigError
from plait.plan.execution import NONFINITE_ACTIONS, Execution
from plait.schedule.registry import SCHEDULE_NAMES, SEARCH_ORDER, schedule_spec, virtual_hint

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """How to split and run the model.

    What is left open is planned when the model first sees data (`plait.planner.layout`): with no
    size at all (none of layers_per_proc, split_points, num_stages, dp, num_microbatches, plan)
    rank 0 profiles the model and the cost model chooses pp, dp, micro-batches, schedule and
    recomputation (the search honours a schedule or recompute given); with a size but no cut
    (layers_per_proc or split_points), the layers are cut by the cost model's optimal partition
    for that layout.
    Every rank gets rank 0's choice. One process (no launcher) runs one stage, unplanned.

    layers_per_proc: captured layers on each pipeline stage, in order (None: planned).
        With num_virtual_stages = v > 1 it lists every model chunk, num_stages x v entries.
    split_points: the cut given by module names instead of counts (None: planned): qualified
        names as in `net.named_modules()` (e.g. ["model.layers.6"] or ["transformer.h.2"]), each
        starting a new stage at the first captured layer that runs in that module, in the
        model's order: len + 1 stages (with v > 1, len + 1 = num_stages x v chunks). Like
        torch.distributed.pipelining's SplitPoint.BEGINNING. Not with layers_per_proc or plan.
    leaf_modules: modules to keep whole, not traced into (one opaque layer each, its own forward
        run as it is): qualified names as in `net.named_modules()`, or class names (or classes)
        for every instance. plait keeps a module whole by itself where torch.export stops in it.
    zero: 1 shards each stage's optimizer state over its dp replicas (ZeRO stage 1: each replica
        steps its share of the parameters, whole ones, then broadcasts them); 2 also shards the
        gradients (each bucket reduced to the owners of its parameters instead of all-reduced,
        and the others' gradients freed before the optimizer step); 0 replicates both. None
        (default): the planner chooses, else 0. Needs dp > 1 (or a dp_per_stage of a stage > 1).
    init_fn: for a model built on the meta device, fn(module) initialising one module's own
        tensors in place (None: a Hugging Face model's `_init_weights`, else each module's
        `reset_parameters()`), called under an RNG seeded by (seed, module name) so values do not
        depend on the layout (`plait.materialize`). A function: `to_dict` leaves it out.
    num_stages: pipeline stages, i.e. ranks per pipeline (None: the length of `layers_per_proc`
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
        inputs and output gradients to the step's end. None: the planner's choice (else False).
    trace_dir: write each rank's measured timeline there as Chrome trace JSON (None: no trace).
    seed: seeds the shuffle order, identical on every rank.
    timeout_s: longest any wait on another rank may take before the run fails with a report.
    dp: data-parallel replicas of the pipeline; world size = dp x num_stages x tp.
    tp: tensor-parallel ranks per stage (Megatron-LM's layout, found on the captured graph: linear
        pairs column- then row-parallel, attention by heads, the word embedding and the LM head
        by vocabulary rows); tp ranks are consecutive (one node). Default None: the planner chooses
        it (1, 2, 4 or 8 within a node) where it plans the whole layout by timing, else 1.
    tp_per_stage: one tp per pipeline stage, for stages of different widths (Alpa's cross-mesh
        resharding), e.g. (2, 1) with layers_per_proc=(a, b): stage 0 on ranks 0 1, stage 1 on rank 2
        (the stages' ranks in order; world size = their sum x dp: with dp=2, a second copy of the
        pipeline on ranks 3 4 | 5, each stage's gradients all-reduced over the copies, and ZeRO
        sharding over them). A stage output crosses as `crossing` says (`plait.cost.tiles`). Needs
        the cut (layers_per_proc or split_points); not with interleaving, tp_plan, sequence
        parallelism, a plan file or replan (refused by name). Checkpoints and exports are by name,
        as for any layout: they load into any other, and any other's into these. None: one tp for
        every stage (`tp`).
    crossing: with tp_per_stage, how a value crosses between stages of different widths: "tiles"
        (once over the link, tile by tile; the receiving stage all-gathers it, Alpa's) or "whole"
        (every receiving rank gets all of it; nothing gathered). None: "tiles", or the planner's
        choice by its cost model where it chose the widths.
    dp_per_stage: one dp per pipeline stage, for stages of different data-parallel widths, e.g.
        (2, 1) with layers_per_proc=(a, b): stage 0 on ranks 0 1 (two replicas, each running half
        the rows of every micro-batch), stage 1 on rank 2 (world size = their sum). Activations cross
        by row blocks and their gradients back (`plait.cost.row_blocks`); each micro-batch's rows
        must divide by every stage's dp. Needs the cut and tp=1; not with grad_reduction="sum" nor
        what tp_per_stage refuses but ZeRO (refused by name); with zero, each stage of replicas
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
    """

    layers_per_proc: tuple[int, ...] | None = None
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
    tp_per_stage: tuple[int, ...] | None = None
    crossing: str | None = None
    dp_per_stage: tuple[int, ...] | None = None
    recompute_by_layer: bool | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._check_tp()
        check_tp_per_stage(self)
        check_dp_per_stage(self)
        self._check_leaf_modules()
        self._check_layout()
        self._check_zero()
        self._check_init_fn()
        self._check_schedule()
        self._check_recompute()
        self._check_running()
        self._check_checkpoints()
        self._check_planning()

    def _check_tp(self) -> None:
        """tp: a positive integer; tp_plan: {pattern: strategy} (kept as a tuple of its items)."""
        if self.tp is not None and (not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1):
            raise ConfigError(f"tp must be a positive integer (tensor-parallel ranks per stage) or None (the "
                              f"planner chooses), got {self.tp!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        plan = self.tp_plan
        if plan is None:
            return
        items = tuple(plan.items()) if isinstance(plan, dict) else tuple(tuple(x) for x in plan)
        bad = [(k, v) for k, v in items if not isinstance(k, str) or not isinstance(v, str)
               or (v not in TP_STRATEGIES and not TP_PLACEMENT.fullmatch(v))]
        if bad:
            raise ConfigError(f"tp_plan entries {bad} are not pattern: strategy; a strategy is one of "
                              f"{TP_STRATEGIES} or the weight's placement ('Shard(0)', 'Shard(1)', 'Replicate()'), "
                              f"e.g. tp_plan={{'*.mlp.c_fc': 'colwise'}}")
        if self.tp == 1:
            raise ConfigError(f"tp_plan={ {k: v for k, v in items} } splits modules over tensor-parallel ranks, but tp=1; set tp > 1")
        object.__setattr__(self, "tp_plan", items)

    def _check_init_fn(self) -> None:
        if self.init_fn is not None and not callable(self.init_fn):
            raise ConfigError(f"init_fn must be a function fn(module) that initialises a module in place, "
                              f"got {self.init_fn!r}")

    def _check_zero(self) -> None:
        """zero: None, 0, 1 or 2, and 1 or 2 only with more than one replica."""
        if self.zero is None:
            return
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2):
            raise ConfigError(f"zero must be 0, 1, 2 or None, got {self.zero!r}")
        if self.zero and self.dp == 1 and max(self.dp_per_stage or (1,)) == 1:
            raise ConfigError(f"zero={self.zero} shards over a stage's replicas, but dp=1 has "
                              "one replica; set dp > 1 or zero=0")

    def _check_leaf_modules(self) -> None:
        """leaf_modules: names or classes; a class is kept by its name (the config stays JSON)."""
        items = self.leaf_modules
        if isinstance(items, (str, type)) or not isinstance(items, (list, tuple)):
            raise ConfigError(
                f"leaf_modules must be a list of module names or classes, got {items!r}; for example "
                "leaf_modules=['model.layers.0.mlp'] or leaf_modules=[MixtralSparseMoeBlock]"
            )
        names = tuple(x.__name__ if isinstance(x, type) else x for x in items)
        bad = [x for x in names if not isinstance(x, str) or not x]
        if bad:
            raise ConfigError(f"leaf_modules={list(items)!r} holds {bad!r}: give module names (as in "
                              "net.named_modules()), class names or module classes")
        object.__setattr__(self, "leaf_modules", names)

    def _check_layout(self) -> None:
        """layers_per_proc, split_points, num_stages and dp: sizes, and the cut against the stages."""
        if self.layers_per_proc is not None:
            self._check_layers()
        if self.split_points is not None:
            self._check_split_points()
        if self.num_stages is not None and (not isinstance(self.num_stages, int) or self.num_stages < 1):
            raise ConfigError(f"num_stages must be a positive integer or None, got {self.num_stages!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1):
            raise ConfigError(f"dp must be a positive integer (data-parallel replicas), got {self.dp!r}")

    def _check_layers(self) -> None:
        lpp = self.layers_per_proc
        if lpp is None:
            return
        if isinstance(lpp, (str, bytes)) or not hasattr(lpp, "__iter__"):
            raise ConfigError(f"layers_per_proc must be a list of layer counts, one per stage, got {lpp!r}; "
                              "for example layers_per_proc=[2, 3, 3]")
        counts = tuple(lpp)
        bad = [c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]
        if not counts or bad:
            raise ConfigError(f"layers_per_proc={list(counts)} must hold one positive integer per stage "
                              f"(bad entries: {bad}); every stage needs at least one layer")
        object.__setattr__(self, "layers_per_proc", counts)
        v = self.num_virtual_stages if isinstance(self.num_virtual_stages, int) else 1
        if v > 1 and len(counts) % v:
            raise ConfigError(f"layers_per_proc={list(counts)} has {len(counts)} entries, not a multiple of "
                              f"num_virtual_stages={v}; with interleaving it lists every model chunk "
                              f"(num_stages x {v} entries)")
        if v > 1 and self.num_stages is not None and self.num_stages * v != len(counts):
            raise ConfigError(f"num_stages={self.num_stages} x num_virtual_stages={v} = {self.num_stages * v} "
                              f"chunks but layers_per_proc={list(counts)} has {len(counts)} entries; make them agree")
        if v == 1 and self.num_stages is not None and self.num_stages != len(counts):
            raise ConfigError(f"num_stages={self.num_stages} but layers_per_proc={list(counts)} has "
                              f"{len(counts)} entries; give one of them, or make them agree")

    def _check_split_points(self) -> None:
        """split_points: a list of distinct names, not with layers_per_proc, against the stages."""
        points = self.split_points
        if points is None:
            return
        if isinstance(points, (str, bytes)) or not hasattr(points, "__iter__"):
            raise ConfigError(f"split_points must be a list of module names, each starting a new stage, got "
                              f"{points!r}; for example split_points=['model.layers.6'] (names as in net.named_modules())")
        names = tuple(points)
        bad = [p for p in names if not isinstance(p, str) or not p]
        if bad:
            raise ConfigError(f"split_points={list(names)} must hold module names, non-empty strings as in "
                              f"net.named_modules() (bad entries: {bad})")
        twice = sorted({p for p in names if names.count(p) > 1})
        if twice:
            raise ConfigError(f"split_points={list(names)} names {twice} more than once; each name starts one "
                              "stage: list it once")
        object.__setattr__(self, "split_points", names)
        if self.layers_per_proc is not None:
            raise ConfigError(f"split_points={list(names)} and layers_per_proc={list(self.layers_per_proc)} both "
                              "give the cut; keep one of them (split_points names the module each stage after "
                              "the first starts at, layers_per_proc counts the layers of each stage)")
        chunks = len(names) + 1
        v = self.num_virtual_stages if isinstance(self.num_virtual_stages, int) else 1
        if v > 1 and chunks % v:
            raise ConfigError(f"split_points={list(names)} cut the model into {chunks} chunks, not a multiple of "
                              f"num_virtual_stages={v}; with interleaving name num_stages x {v} - 1 points")
        if v > 1 and self.num_stages is not None and self.num_stages * v != chunks:
            raise ConfigError(f"num_stages={self.num_stages} x num_virtual_stages={v} = {self.num_stages * v} "
                              f"chunks but split_points={list(names)} cut {chunks}; name "
                              f"{self.num_stages * v - 1} points, or make num_stages agree")
        if v == 1 and self.num_stages is not None and self.num_stages != chunks:
            raise ConfigError(f"num_stages={self.num_stages} but split_points={list(names)} cut {chunks} stages "
                              f"(one more than the points); give one of them, or name {self.num_stages - 1} points")

    def _check_schedule(self) -> None:
        """num_microbatches, schedule and num_virtual_stages."""
        m = self.num_microbatches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError(f"num_microbatches must be a positive integer, got {self.num_microbatches!r}")
        if self.schedule is not None and self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"schedule={self.schedule!r} is not known; choose one of {list(SCHEDULE_NAMES)}")
        v = self.num_virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"num_virtual_stages must be a positive integer, got {v!r}")
        if v > 1 and (self.schedule is None or not schedule_spec(self.schedule).virtual):
            raise ConfigError(
                f"num_virtual_stages={v} needs {virtual_hint()}, got schedule="
                f"{self.schedule or '1f1b'!r}{'' if self.schedule else ' (the default)'}"
            )

    def _check_running(self) -> None:
        """trace_dir, grad_reduction, bucket_cap_mb, timeout_s and seed."""
        if self.trace_dir is not None and not isinstance(self.trace_dir, (str, bytes)) and not hasattr(
            self.trace_dir, "__fspath__"
        ):
            raise ConfigError(f"trace_dir must be a directory path or None, got {self.trace_dir!r}")
        if self.trace_dir is not None:
            object.__setattr__(self, "trace_dir", str(self.trace_dir))
        if self.grad_reduction not in ("mean", "sum"):
            raise ConfigError(f"grad_reduction={self.grad_reduction!r} is not known; choose 'mean' or 'sum'")
        if not (_is_number(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ConfigError(f"bucket_cap_mb must be a positive number, got {self.bucket_cap_mb!r}")
        if not (_is_number(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an integer (it seeds the shuffle order), got {self.seed!r}")

    def _path(self, name: str, what: str) -> str | None:
        """Field `name` as a str path (any os.PathLike is accepted), or None."""
        value = getattr(self, name)
        if value is None:
            return None
        if not isinstance(value, str) and not hasattr(value, "__fspath__"):
            raise ConfigError(f"{name} must be {what} or None, got {value!r}")
        object.__setattr__(self, name, str(value))
        return str(value)

    def _check_planning(self) -> None:
        if self._path("plan", "the path of a plan JSON file") is not None and self.layers_per_proc is not None:
            raise ConfigError(f"plan={self.plan!r} and layers_per_proc={list(self.layers_per_proc)} both give "
                              "the layers of each stage; keep one of them")
        if self.plan is not None and self.split_points is not None:
            raise ConfigError(f"plan={self.plan!r} and split_points={list(self.split_points)} both give the "
                              "layers of each stage; keep one of them")
        limit = self.memory_limit_bytes
        if limit is not None and not (_is_number(limit) and limit > 0):
            raise ConfigError(f"memory_limit_bytes must be a positive number of bytes or None, got {limit!r}")
        if self.replan is not None and not isinstance(self.replan, bool):
            raise ConfigError(f"replan must be True, False or None (as `plait run --replan` says), got {self.replan!r}")
        if self.batch_weight_grads is not None and not isinstance(self.batch_weight_grads, bool):
            raise ConfigError(f"batch_weight_grads must be True or False (or None: the planner's choice), "
                              f"got {self.batch_weight_grads!r}")

    @property
    def plans_everything(self) -> bool:
        """No size given (layers_per_proc, split_points, num_stages, dp, num_microbatches, plan):
        the planner chooses the whole layout."""
        return (self.layers_per_proc is None and self.split_points is None and self.num_stages is None
                and self.dp is None and self.num_microbatches is None and self.plan is None)

    def with_defaults(self) -> "Config":
        """This config with every field left open set to its unplanned default (dp 1,
        1 micro-batch, "1f1b", no recomputation, weight gradients per micro-batch)."""
        return replace(self, dp=self.dp or 1, num_microbatches=self.num_microbatches or 1, tp=self.tp or 1,
                       tp_plan=self.tp_plan if self.tp else None,
                       schedule=self.schedule or "1f1b",
                       recompute=False if self.recompute is None else self.recompute,
                       batch_weight_grads=bool(self.batch_weight_grads))

    def _check_checkpoints(self) -> None:
        self._path("checkpoint_dir", "a directory path")
        every = self.checkpoint_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ConfigError(f"checkpoint_every must be a positive number of steps or None (every epoch), got {every!r}")
        keep = self.checkpoint_keep
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"checkpoint_keep must be a positive integer (2 keeps a fallback), got {keep!r}")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r} is not known; choose one of {list(NONFINITE_ACTIONS)}")

    def _check_recompute(self) -> None:
        for name, words in (("recompute", ("auto",)), ("recompute_by_layer", ())):
            r = getattr(self, name)
            if r is None or isinstance(r, bool) or r in words:
                continue
            if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
                known = ", ".join(["True", "False", *(repr(w) for w in words)])
                raise ConfigError(f"{name}={r!r} is not known; use {known} or a list of stage indices")
            stages = tuple(r)
            bad = [s for s in stages if not isinstance(s, int) or isinstance(s, bool) or s < 0]
            if bad:
                raise ConfigError(f"{name}={list(stages)} must list stage indices >= 0 (bad entries: {bad})")
            object.__setattr__(self, name, stages)

    def execution(self) -> Execution:
        """The runtime's settings beside the plan (the runtime reads these, not the Config)."""
        return Execution(timeout_s=float(self.timeout_s), trace_dir=self.trace_dir, on_nonfinite=self.on_nonfinite,
                         grad_reduction=self.grad_reduction, bucket_bytes=int(self.bucket_cap_mb * 2**20),
                         memory_limit_bytes=self.memory_limit_bytes)

    def lanes(self, world_size: int) -> int:
        """Ranks per tensor-parallel part (world size / tp): the pp x dp ranks the layout is planned on
        (tp=None: the world, until the planner chooses tp)."""
        lanes = stage_lanes(self, world_size)  # stages of different widths: one lane per stage
        if lanes is not None:
            return lanes
        if self.tp is None:
            return world_size
        if world_size % self.tp:
            factors = [f for f in range(1, world_size + 1) if world_size % f == 0]
            raise ConfigError(
                f"world size {world_size} does not factor as pp x dp x tp with tp={self.tp} (pp={self.num_stages}, "
                f"dp={self.dp}); tp must be one of {world_size}'s factors {factors}, or launch a multiple of {self.tp} ranks")
        return world_size // self.tp

    def stages_for(self, world_size: int) -> int:
        """Pipeline stages (ranks per pipeline) on `world_size` ranks; world size must be dp x stages."""
        if self.layers_per_proc is not None:
            stages: int | None = len(self.layers_per_proc) // self.num_virtual_stages
        elif self.split_points is not None:
            stages = (len(self.split_points) + 1) // self.num_virtual_stages
        else:
            stages = self.num_stages
        dp = self.dp or 1
        if stages is None:
            if world_size % dp:
                raise ConfigError(
                    f"world size {world_size} does not divide by dp={dp}; launch a multiple "
                    f"of {dp} ranks, or set dp to a factor of {world_size}"
                )
            return world_size // dp
        if stages * dp != world_size:
            lpp = None if self.layers_per_proc is None else list(self.layers_per_proc)
            cut = (f"layers_per_proc={lpp}" if self.split_points is None
                   else f"split_points={list(self.split_points)}")
            tp = self.tp or 1
            raise ConfigError(
                f"the config asks for {stages} pipeline stages x dp={dp} replicas"
                f"{f' x tp={tp}' if tp > 1 else ''} = {stages * dp * tp} ranks ({cut}, num_stages={self.num_stages}, "
                f"dp={dp}) but the world size is {world_size * tp}; launch "
                f"{stages * dp * tp} ranks (plait run -n {stages * dp * tp} ...) or change the config"
            )
        return stages

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON-ready values."""
        d = asdict(replace(self, init_fn=None))
        for name in ("layers_per_proc", "split_points", "leaf_modules", "tp_per_stage", "dp_per_stage"):
            if d[name] is not None:
                d[name] = list(d[name])
        for name in ("recompute", "recompute_by_layer"):
            if isinstance(d[name], tuple):
                d[name] = list(d[name])
        if d["tp_plan"] is not None:
            d["tp_plan"] = {str(k): str(v) for k, v in d["tp_plan"]}
        return d

    @classmethod
    def from_dict(cls, data: Any) -> "Config":
        """The Config of `to_dict()` output (unknown names are an error; missing ones default)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a Config is a JSON object of its fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ConfigError(f"unknown Config fields {unknown}; known: {sorted(known)}")
        values = dict(data)
        for name in ("layers_per_proc", "split_points", "leaf_modules", "recompute", "recompute_by_layer"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        try:
            return cls(**values)
        except ConfigError:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # a field of the wrong type deep inside a check
            raise ConfigError(f"not a valid Config ({type(e).__name__}: {e}); expected Config.to_dict() output") from None

    def to_json(self) -> str:
        """The fields as a JSON object."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Config":
        """The Config of `to_json()` output; anything else raises ConfigError."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"not a plait Config: not JSON ({type(e).__name__}: {e})") from None
        return cls.from_dict(data)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
