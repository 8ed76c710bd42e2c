"""`StepRunner`: one global batch through this rank's pipeline, from micro-batches to the optimizer step.

A step, in order (every rank of the job runs the same sequence):

    cut this replica's rows into micro-batches (each loss scaled for the global mean)
    -> run the schedule's program for this rank (the interpreter); after its last forward, this
       rank's loss/metric sums (last stage only) and non-finite flags start their sum over the
       job, which travels while the backward passes run and the gradient buckets are all-reduced
       (in a training step of one rank per stage, they ride on the pipeline's own messages
       instead: `plait.runtime.riding_sums`)
    -> finish the gradient all-reduces and the tied-parameter sums
    -> the non-finite verdict (stop / skip / ignore), then the optimizer step

A collective that fails in it becomes a `PipelineError` naming this rank, the step, and the
ranks that went silent (`plait.runtime.failure`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait import data as batching
from plait.capture.output import flatten_output
from plait.capture.trace import CapturedGraph, in_mode
from plait.cost.row_blocks import check_rows, row_block
from plait.errors import ConfigError, PipelineError, PlaitError, first_line
from plait.runtime.failure import failure_error, gather_failures, report_wait
from plait.runtime.interpreter import MicroBatch
from plait.runtime.update.grad_norm import clip_to, global_norm
from plait.runtime.update.loss_scale import LossScale
from plait.runtime.update.nonfinite import NonFiniteWatch, verdict
from plait.runtime.output_rows import join_microbatches, join_parts, leaf_names, row_leaves
from plait.runtime.pipeline import Pipeline
from plait.runtime.step_sums import StepSums

__all__ = ["OptimizerArg", "StepResult", "StepRunner", "held_bytes", "make_optimizer", "rides"]

# The user's optimizer: an instance (over the whole net), or a callable made over this rank's parameters.
OptimizerArg = torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None


def held_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the storages behind `tensors` (each once; a gradient that is a view of its bucket
    counts the whole bucket it lives in; None and non-tensors skipped)."""
    storages: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):  # zero=3: a shard's gradient, this rank's part
            t = t.to_local()
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def gradient_bytes(pipe: Pipeline) -> int:
    """Bytes of this rank's gradients: its buckets' buffers (held whether or not a parameter's
    .grad still points into them) and the gradients of parameters outside the buckets."""
    if pipe.sync is None:
        return held_bytes(p.grad for p in pipe.local_parameters)
    return pipe.sync.held_bytes + held_bytes(p.grad for p in pipe.local_parameters if not pipe.sync.holds(p))


def make_optimizer(arg: OptimizerArg, params: list[nn.Parameter], sharded: bool = False) -> torch.optim.Optimizer | None:
    """The optimizer of this rank's parameters: the user's, or made by their callable (given one
    empty parameter group when this rank's stages have no parameters: a cut between a block's
    parameter-free layers, whose step then changes nothing). `sharded` (zero=3): only a callable,
    since an optimizer made over the whole model would step parameters no rank holds whole."""
    if isinstance(arg, torch.optim.Optimizer) and sharded:
        raise ConfigError("zero=3 steps each rank's shards of the parameters, so the optimizer must be made "
                          "over them: pass a callable, e.g. optimizer=lambda params: torch.optim.Adam(params, lr=1e-3)")
    if arg is None or isinstance(arg, torch.optim.Optimizer):
        return arg
    if callable(arg):
        empty: Any = [{"params": []}]  # one parameter group, as torch's optimizers take it
        return arg(params if params else empty)
    raise ConfigError(
        f"optimizer must be a torch.optim.Optimizer or a callable params -> optimizer, got {type(arg).__name__}"
    )


@dataclass(frozen=True)
class StepResult:
    """What one global batch gave, the same `sums` on every rank."""

    sums: list[float]  # [sum of loss x rows, then (correct, counted) per metric] over the batch
    outputs: list[Any] | None  # this rank's last-stage outputs, one per micro-batch (if kept)
    skipped: bool  # a non-finite value with on_nonfinite="skip": no optimizer step


class StepRunner:
    """Runs global batches on one `Pipeline` (train or eval) for this rank."""

    def __init__(self, pipe: Pipeline, net: nn.Module, metrics: Sequence[str], device: torch.device,
                 train: bool) -> None:
        self.pipe, self.net, self.metrics, self.device, self.train = pipe, net, list(metrics), device, train
        execution = pipe.execution
        self.watch = NonFiniteWatch(pipe) if train and execution.on_nonfinite != "ignore" else None
        self.rides = train and rides(pipe)  # the step's sums ride on the pipeline's messages
        self.carried: dict[int, tuple[dict[int, int], dict[int, int]]] = {}  # micro-batches -> carriers
        self.memory: dict[str, int | None] = {}  # the last training step's readings, bytes (`memory_stats`)
        self.grad_norm: float | None = None  # the last step's global gradient norm, before clipping (clip_grad_norm)
        self._accumulated_skip = False  # accumulate_steps: a batch before the step's last had a non-finite value
        if train:
            mine = {id(p) for p in pipe.local_parameters}
            for p in net.parameters():  # stale gradients elsewhere would make the
                if id(p) not in mine:   # optimizer step parameters this rank does not train
                    p.grad = None

    def for_eval(self, loss: Callable[[Any, Any], torch.Tensor] | None,
                 capture_eval: Callable[[str], CapturedGraph]) -> "StepRunner":
        """The runner of the same split for evaluation, on the model captured once more in eval
        mode by `capture_eval(method)` with the training graph's capture method.

        Every tracer bakes the mode in (torch.fx too: it reads `self.training` while tracing, so
        functional dropout and `if self.training:` branches stay on in its training graph).
        """
        captured = capture_eval(self.pipe.captured.method)
        return StepRunner(self.pipe.for_eval(captured, loss), self.net, self.metrics, self.device, train=False)

    def gather_outputs(self, outputs: list[Any] | None, rows: int) -> list[Any]:
        """The flat output leaves of a batch of `rows` rows from every replica, joined in row order,
        on every rank (`outputs`: this rank's last-stage outputs, one per micro-batch, if any).

        Messages are keyed by the batch's rows, so batches of one size reuse their description.
        A leaf that is not per row comes back as a list of its values, one per micro-batch
        (`plait.runtime.output_rows`). A rank that fails to join its own outputs stops the others
        at once, naming itself, rather than leave them waiting for its outputs.
        """
        pipe = self.pipe
        try:
            local = self._join_local(outputs, rows) if outputs else None
        except Exception as e:  # noqa: BLE001 - this rank's own failure: every other rank is told
            cause = f"failed joining its micro-batches' outputs of predict: {type(e).__name__}: {first_line(e)}"
            gather_failures(-1, pipe.rank, -1, report_wait(pipe.execution.timeout_s), cause)
            raise PipelineError(f"rank {pipe.rank} {cause}; every other rank was stopped") from e
        if pipe.plan.stage_dp:
            return self._gather_row_blocks(local, rows)
        shard_rows = [hi - lo for lo, hi in batching.shard_bounds(rows, pipe.plan.dp)]
        try:
            return join_parts(pipe.gather_outputs(local, shard_rows, ("predict", rows)))
        except PlaitError:
            raise
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: name it
            raise failure_error("gathering the outputs of predict", pipe.rank, e, pipe.execution.timeout_s) from e

    @cached_property
    def _row_leaves(self) -> tuple[bool, ...] | None:
        """Per output leaf, whether it is per row (`output_rows`; None: the capture cannot tell)."""
        return row_leaves(self.pipe.captured)

    def _join_local(self, outputs: list[Any], rows: int) -> list[Any]:
        """This rank's last-stage outputs of a batch of `rows` rows, one leaf list (`join_microbatches`)."""
        pipe = self.pipe
        if pipe.plan.stage_dp:  # each micro-batch's block of rows
            replicas = pipe.plan.dp_of(pipe.plan.num_chunks - 1)
            sizes = [(b - a) // replicas for a, b in batching.microbatch_bounds(rows, pipe.plan.num_microbatches)]
        else:
            start, stop = batching.shard_bounds(rows, pipe.plan.dp)[pipe.replica]
            sizes = [b - a for a, b in batching.microbatch_bounds(stop - start, pipe.plan.num_microbatches)]
        joined = join_microbatches([flatten_output(o)[0] for o in outputs], sizes, self._row_leaves)
        apart = [i for i, leaf in enumerate(joined) if isinstance(leaf, list)]
        if apart and pipe.plan.stage_dp:
            names = leaf_names(pipe.output_spec)
            shapes = [tuple(v.shape) for v in joined[apart[0]]]
            raise ConfigError(f"{names[apart[0]]} is not per row (its shape per micro-batch block: {shapes}), "
                              "and stage_dp splits each micro-batch's rows: predict with stage_dp=None, "
                              "or return per-row outputs")
        return joined

    def _gather_row_blocks(self, local: list[Any] | None, rows: int) -> list[Any]:
        """`gather_outputs` with stage_dp: each replica of the last stage holds its block of every
        micro-batch's rows (in micro-batch order); the blocks are joined micro-batch by micro-batch."""
        pipe = self.pipe
        replicas = pipe.plan.dp_of(pipe.plan.num_chunks - 1)
        try:
            held = pipe.gather_outputs(local, [1] * replicas, ("predict", rows))
        except PlaitError:
            raise
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: name it
            raise failure_error("gathering the outputs of predict", pipe.rank, e, pipe.execution.timeout_s) from e
        pieces: list[list[Any]] = []
        offset = 0
        for a, b in batching.microbatch_bounds(rows, pipe.plan.num_microbatches):
            share = (b - a) // replicas
            pieces += [batching.slice_rows(leaves, offset, offset + share) for leaves in held]
            offset += share
        return batching.join_rows(pieces)

    def _row_blocks(self, x: Any, y: Any) -> list[MicroBatch]:
        """`microbatches` with stage_dp: every micro-batch of the global batch, cut into this
        replica's equal block of its rows (each stage's replicas share every micro-batch)."""
        pipe = self.pipe
        rows = batching.num_rows(x)
        stage, replica = pipe.plan.position_of(pipe.rank)
        x, y = batching.to_device(x, self.device), batching.to_device(y, self.device)
        out: list[MicroBatch] = []
        for a, b in batching.microbatch_bounds(rows, pipe.plan.num_microbatches):
            check_rows(b - a, pipe.plan.stage_dp, f"micro-batch {len(out)} (rows {a}:{b} of a batch of {rows})")
            lo, hi = row_block(b - a, pipe.plan.dp_of(stage), replica)
            args, kwargs = batching.as_call(batching.slice_rows(x, a + lo, a + hi))
            inputs = pipe.captured.bind(args, kwargs)
            key = (b - a, tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)))
            target = None if y is None else batching.slice_rows(y, a + lo, a + hi)
            out.append(MicroBatch(inputs, target, (hi - lo) / rows, key, b - a))  # "mean": Config refuses "sum"
        return out

    def microbatches(self, x: Any, y: Any) -> list[MicroBatch]:
        """This replica's shard of a global batch, cut into micro-batches.

        Each micro-batch's loss is scaled so the summed gradients are those of the global mean
        loss ("mean"), or of this replica's own mean loss ("sum").
        """
        pipe, execution = self.pipe, self.pipe.execution
        if pipe.plan.stage_dp:
            assert not isinstance(x, batching.Share), "stage_dp: every rank reads whole batches"
            return self._row_blocks(x, y)
        rows = batching.global_rows(x)
        start, stop = batching.shard_bounds(rows, pipe.plan.dp)[pipe.replica]
        if stop == start:
            return []
        x, y, offset = batching.replica_rows(x, y, start, stop, f"replica {pipe.replica} of dp={pipe.plan.dp}")
        denominator = rows if execution.grad_reduction == "mean" else stop - start
        x, y = batching.to_device(x, self.device), batching.to_device(y, self.device)
        out = []
        for a, b in batching.microbatch_bounds(stop - start, pipe.plan.num_microbatches):
            xs = batching.slice_rows(x, offset + a, offset + b)
            args, kwargs = batching.as_call(xs)
            inputs = pipe.captured.bind(args, kwargs)
            key = tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
            target = None if y is None else batching.slice_rows(y, offset + a, offset + b)
            out.append(MicroBatch(inputs, target, (b - a) / denominator, key, b - a))
        return out

    def run(self, x: Any, y: Any, keep_outputs: bool, steps_done: int,
            optimizer: torch.optim.Optimizer | None, where: str = "") -> StepResult:
        """Run one global batch on every replica (training: one optimizer step).

        `steps_done` counts the training steps before this one (it names the step in errors
        and traces); `where` names the batch in errors where the caller knows it (its epoch).
        """
        pipe, train = self.pipe, self.train
        mbs = self.microbatches(x, y)
        whole = pipe.whole_parameters() if not train else contextlib.nullcontext()  # zero=3: evaluation gathers
        with in_mode(self.net, train), whole:  # each module's own flag comes back after
            if pipe.copies is not None:  # the stages compute with the masters' current values
                pipe.copies.refresh()
            k = pipe.execution.accumulate_steps  # global batches per optimizer step
            first, last = steps_done % k == 0, steps_done % k == k - 1
            if train:  # each loss times fp16's scale, over the batches summed into one step
                for ex in pipe.executors.values():
                    ex.loss_scale = (pipe.loss_scale.scale if pipe.loss_scale is not None else 1.0) / k
                self._zero_grads(len(mbs), first, last)
            for ex in pipe.executors.values():
                ex.reset()
            if self.watch is not None:
                self.watch.start()
            started = StepSums(self, mbs, keep_outputs)
            if mbs:
                program = pipe.program(len(mbs), train)
                riding = started.riding(program) if self.rides else None
                pipe.interpreter.run(program, mbs, train, keep_outputs=keep_outputs or bool(self.metrics),
                                     after_forwards=None if riding else started.start,
                                     forwards_done_at_weights=pipe.plan.num_stages > 1, sums=riding,
                                     where=where or (f"training step {steps_done + 1}" if train
                                                     else f"an evaluation batch after step {steps_done}"))
            else:
                started.start()
            if train:  # every backward has run: the gradients are whole, the activations freed
                self.memory["gradients_bytes"] = gradient_bytes(pipe)
            if train and last and pipe.sync is not None:
                pipe.sync.flush()  # the buckets no gradient hook launched (after the sums, as everywhere)
            stats, outputs, total = started.stats, started.outputs, started.total
            place = _Where(self, steps_done, len(mbs))
            if train and last:
                self._finish_gradients(place)
            sums = place.guard("the loss all-reduce", total)
            skipped = False
            if train and last:
                skipped = self._optimizer_step(sums[len(stats):], place, optimizer)
            elif train and self.watch is not None:  # a batch summed into a later step: stop now, or skip that step
                self._accumulated_skip |= verdict(sums[len(stats):], pipe.plan, steps_done + 1,
                                                  pipe.execution.on_nonfinite, pipe.rank)
        return StepResult(sums[: len(stats)], outputs, skipped)

    def _zero_grads(self, num_microbatches: int, first: bool = True, last: bool = True) -> None:
        """Before a training batch: gradients cleared at the first batch of a step; the buckets
        listen at its last (with accumulate_steps > 1 the batches before only sum locally)."""
        if self.pipe.meter is not None:
            self.pipe.meter.start_step()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if first:
            for p in self.pipe.local_parameters:
                p.grad = None
        if self.pipe.sync is not None and last:
            self.pipe.sync.prepare(num_microbatches, keep_grads=not first)
        if self.pipe.sharded is not None:  # zero=3: the last batch's last backward reduce-scatters
            self.pipe.sharded.prepare(num_microbatches, sync=last)

    def _overflowed(self, scale: LossScale, where: "_Where") -> bool:
        """fp16: whether any rank's gradients overflowed (then every rank skips the step and the
        scale backs off), else the gradients unscaled for the step; GradScaler's update either way."""
        grads = [p.grad for p in self.pipe.local_parameters]
        found = where.guard("the loss scale's overflow check",
                            lambda: [float(scale.found_nonfinite(grads, self.pipe.plan.world_size))])[0] > 0
        if not found:
            scale.unscale(grads)
        scale.update(found)
        return found

    def _finish_gradients(self, where: "_Where") -> None:
        """The data-parallel buckets' and the tied parameters' all-reduces, waited for."""
        pipe = self.pipe

        def finish() -> list[float]:
            if pipe.sync is not None:
                pipe.sync.finish()
            if pipe.ties is not None:
                pipe.ties.sum()
            return []

        with pipe.interpreter.tracer.span("allreduce", "gradients", step=where.run):
            where.guard("the gradient all-reduce", finish)

    def _optimizer_step(self, flags: list[float], where: "_Where",
                        optimizer: torch.optim.Optimizer | None) -> bool:
        """The non-finite verdict (raises NonFiniteError for "stop"), then the step; True if skipped."""
        pipe = self.pipe
        skipped, self._accumulated_skip = self._accumulated_skip, False  # an earlier batch of this step's
        if self.watch is not None:
            skipped = verdict(flags, pipe.plan, where.steps_done + 1, pipe.execution.on_nonfinite, pipe.rank) or skipped
        assert optimizer is not None
        if not skipped and pipe.loss_scale is not None and self._overflowed(pipe.loss_scale, where):
            return False  # fp16: a gradient overflowed on some rank: no step anywhere, a smaller scale
        if not skipped:
            clip = pipe.execution.clip_grad_norm
            if clip is not None:  # the whole model's norm (one all-reduce), then every gradient scaled to it
                self.grad_norm = where.guard("the gradient norm's all-reduce", lambda: [global_norm(pipe)])[0]
                clip_to(pipe, self.grad_norm, clip)
            if pipe.zero is not None:  # others' shares: no gradient, no step, no state here
                pipe.zero.drop_foreign_gradients()
            self.memory["gradients_at_step_bytes"] = gradient_bytes(pipe)
            with pipe.interpreter.tracer.span("compute", "optimizer", step=where.run, op="opt"):
                optimizer.step()
            self.memory["optimizer_bytes"] = held_bytes(
                t for state in optimizer.state.values() for t in state.values())
            if pipe.meter is not None:  # None: not measured (the caller's saved-tensor hooks were on)
                self.memory["activations_peak_bytes"] = None if pipe.meter.blind else pipe.meter.peak
            if self.device.type == "cuda":
                self.memory["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            if pipe.zero is not None:
                zero = pipe.zero

                def broadcast() -> list[float]:
                    zero.broadcast()
                    return []

                with pipe.interpreter.tracer.span("allreduce", "sharded parameters", step=where.run):
                    where.guard("the broadcast of sharded parameters", broadcast)
        return skipped


def rides(pipe: Pipeline) -> bool:
    """Whether a training step's sums can ride on the pipeline's messages (`RidingSums`): one rank
    per stage, each stage's neighbours on other ranks, nothing crossing between widths."""
    plan, ranks = pipe.plan, pipe.interpreter.stage_to_rank
    return (plan.num_stages > 1 and plan.world_size == plan.num_stages and not pipe.interpreter.crossings
            and all(plan.dp_of(s) == 1 and plan.tp_of(s) == 1 for s in range(plan.num_chunks))
            and all(a != b for a, b in zip(ranks, ranks[1:])))


class _Where:
    """Where a step stands, for naming a failed collective: the step, the program run, its position."""

    def __init__(self, runner: StepRunner, steps_done: int, num_microbatches: int) -> None:
        pipe = runner.pipe
        self.rank, self.timeout_s, self.steps_done = pipe.rank, pipe.execution.timeout_s, steps_done
        self.run = pipe.interpreter.runs  # a failure below follows this run of the program, all done
        self.label = (f"training step {steps_done + 1}" if runner.train
                      else f"an evaluation batch after step {steps_done}")
        self.position = len(pipe.program(num_microbatches, runner.train).get(pipe.rank, [])) \
            if num_microbatches else 0

    def guard(self, what: str, call: Callable[[], list[float]]) -> list[float]:
        """`call()`; a dead or stalled peer becomes a PipelineError naming it."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: name it
            raise failure_error(f"{what} of {self.label}", self.rank, e, self.timeout_s,
                                self.run, self.position) from e
