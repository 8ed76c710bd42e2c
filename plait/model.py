"""The public `Model`: Keras-like training of an unchanged nn.Module across pipeline stages."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from plait import data as batching
from plait.callbacks import History
from plait.capture.output import unflatten_output
from plait.capture.compute_dtype import as_computed, dtype_of, held_in
from plait.capture.trace import CapturedGraph, capture_batch, retarget
from plait.checkpoint import disk as checkpoint
from plait.checkpoint import train_state, weights
from plait.checkpoint.model_checkpoints import ModelCheckpoints
from plait.config import Config
from plait.config.run_options import apply_run_options
from plait.errors import CheckpointError, ConfigError, PlaitError
from plait.job.process_group import init_process_group
from plait.metrics import check_metrics, logs_of
from plait.plan import Plan
from plait.planner.closed_loop import ClosedLoop
from plait.planner.layout import Layout, Workload, choose_layout, replanned
from plait.planner.plan_report import PlanReport
from plait.runtime.comm.collectives import local_device
from plait.runtime.failure import raised_before_steps
from plait.runtime.memory.memory_stats import memory_line, memory_stats, state_factor
from plait.runtime.output_rows import join_parts
from plait.runtime.pipeline import Pipeline
from plait.runtime.step import OptimizerArg, StepRunner, make_optimizer
from plait.runtime.step_sums import num_stats
from plait.runtime.update.loss_scale import LossScale
from plait.train.export import export_weights, gather_whole_state
from plait.train.fit_loop import FitSteps, run_fit
from plait.train.rank_build import RankPlace, build_rank_pipeline
from plait.train.start import place_net, starting_stages

__all__ = ["Model"]


class Model:
    """Train `net` as a pipeline over every rank of the job; the same script runs on each rank.

    >>> model = Model(net, config=Config(num_microbatches=4), optimizer=opt, loss=nn.CrossEntropyLoss())
    >>> history = model.fit(x, y, epochs=5, batch_size=64)
    """

    def __init__(
        self,
        net: nn.Module,
        config: Config | None = None,
        optimizer: OptimizerArg = None,
        loss: Callable[[Any, Any], torch.Tensor] | None = None,
        metrics: Sequence[str] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ):
        if not isinstance(net, nn.Module):
            raise ConfigError(f"plait.Model needs a torch.nn.Module, got {type(net).__name__}")
        self.net = net
        config = config if config is not None else Config()
        if not isinstance(config, Config):
            raise ConfigError(f"config must be a plait.Config, got {type(config).__name__}")
        self.config = apply_run_options(config)  # the fields `plait run` may set, left open here
        self.loss = loss
        self.metrics = check_metrics(metrics)
        self._optimizer_arg = optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise ConfigError(f"lr_scheduler must be a function of the optimizer, e.g. lambda opt: "
                              f"torch.optim.lr_scheduler.StepLR(opt, 100), got {lr_scheduler!r}")
        self._scheduler_arg = lr_scheduler  # made over this rank's optimizer, stepped after every training step
        self.lr_scheduler: Any = None
        self._scheduler_state: dict[str, Any] | None = None  # a restored checkpoint's, until the scheduler exists
        self.rank, self.world_size = init_process_group(self.config.timeout_s)
        self.device = local_device()
        self._meta = place_net(net, optimizer, self.device)  # on the meta device: each rank materializes its stages
        # one process: every layer on one stage; else 0 until planned, or the size given, checked against the world
        self.config, self.num_stages = starting_stages(self.config, self.world_size)
        self._train: StepRunner | None = None
        self._eval: StepRunner | None = None
        self.step = 0  # training steps (global batches) run, counted on from a loaded checkpoint
        self._checkpoints = ModelCheckpoints(net, self.rank, self.world_size, self.config.timeout_s)
        self._layout: Layout | None = None  # the planned layout, the same on every rank
        self._captured: CapturedGraph | None = None  # the model captured in train mode, once
        self._eval_captured: CapturedGraph | None = None  # a meta model's eval capture, made with it
        self._loop: ClosedLoop | None = None  # the planned run's first steps against the plan

    # -- building ------------------------------------------------------------------------------

    def _runner(self, x: Any, train: bool, y: Any = None) -> StepRunner:
        """The step runner of the training or evaluation pipeline, laid out and built on first use.

        The model is captured once (train mode) on the first batch it sees; the planner and the
        pipeline take that graph. Evaluation captures it once more, in eval mode.
        """
        if self._train is None:
            if self._layout is None:
                if not self._meta:  # traced where the model lives (a meta model: on meta, retargeted)
                    x, y = batching.to_device(x, self.device), batching.to_device(y, self.device)
                with raised_before_steps(self.rank, "while capturing the model"):  # the peers stop too
                    captured = self._capture(x, True, keep=self.config.leaf_modules)
                if self._meta:  # eval too, while every tensor is on meta; device constants made real
                    self._eval_captured = retarget(self._capture(x, False, captured.method, captured.kept_whole),
                                                   self.device)
                    captured = retarget(captured, self.device)
                elif self._frees:  # eval too, while every tensor is real: the build frees the others
                    self._eval_captured = self._capture(x, False, captured.method, captured.kept_whole)
                work = Workload(self.net, captured, x, y, self.loss, self._optimizer_arg, self.device)
                self._layout = choose_layout(work, self.config, self.world_size, self.rank,
                                             self._checkpoints.resumed_plan)
                if self._layout.report is not None:
                    self._loop = ClosedLoop(self._layout.report, self.rank, self.world_size,
                                            self.config.timeout_s, bool(self.config.replan))
                self._captured = work.captured
            self._build(self._layout)
            assert self._train is not None
            self._checkpoints.apply_pending(self._train.pipe, self.optimizer)  # one loaded before the build
            self._load_scheduler()
        assert self._train is not None
        if train:
            return self._train
        if self._eval is None:
            self._eval = self._train.for_eval(
                self.loss, lambda method: self._eval_captured or self._capture(
                    x, False, method, self._captured.kept_whole if self._captured else ()))
        return self._eval

    def _capture(self, x: Any, train: bool, method: str | None = None, keep: Sequence[Any] = ()) -> CapturedGraph:
        """`net` captured on `x` in the dtype its stages compute in (Config.precision: torch.export
        records the dtypes it sees), its parameters' values as they were after."""
        dtype = dtype_of(self.config.precision)
        with held_in(self.net, dtype):
            return capture_batch(self.net, as_computed(x, self.config.precision), train, method, keep)

    @property
    def _frees(self) -> bool:
        """Whether each rank frees the parameters its stages do not use (several ranks; not with an
        optimizer instance, which holds every parameter of the net: nothing could be freed)."""
        return self.world_size > 1 and not isinstance(self._optimizer_arg, torch.optim.Optimizer)

    def _build(self, layout: Layout) -> None:
        """This rank's training pipeline and optimizer for `layout`."""
        assert self._captured is not None
        self.num_stages = layout.num_stages
        first = self._train is None and self.world_size > 1 and not self._meta
        pipe = build_rank_pipeline(self.net, (self._captured, self._eval_captured), layout.plan, self.config,
                                   RankPlace(self.rank, self.device, self._meta, self._frees, first), self.loss)  # this rank's stages made real, the others freed
        self._train, self._eval = StepRunner(pipe, self.net, self.metrics, self.device, train=True), None
        self.optimizer = make_optimizer(self._optimizer_arg, pipe.local_parameters, pipe.sharded is not None)
        carried = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None  # a rebuild (replan)
        self.lr_scheduler = None
        if self._scheduler_arg is not None and self.optimizer is not None:
            self.lr_scheduler = self._scheduler_arg(self.optimizer)
        if carried is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(carried)

    @property
    def replanning(self) -> bool:
        """Whether a step may still move the model to another layout (Config.replan, undecided)."""
        return self._loop is not None and self._loop.replan and not self._loop.done

    @property
    def plan(self) -> Plan:
        """The plan in use (made when the model first sees data)."""
        runner = self._built()
        report = self.plan_report
        plan = runner.pipe.plan
        if report is not None and report.feedback is not None:  # the closed loop has measured
            plan = dataclasses.replace(plan, check=report.feedback.summary())
        if runner.memory:  # a step has run: this rank's memory, measured beside predicted (printed only)
            plan = dataclasses.replace(plan, memory=memory_line(self.memory_stats(), self.rank))
        return plan

    @property
    def grad_norm(self) -> float | None:
        """The last training step's global gradient norm before clipping (Config.clip_grad_norm;
        None without it, or before a step)."""
        return self._train.grad_norm if self._train is not None else None

    @property
    def loss_scale(self) -> LossScale | None:
        """fp16's dynamic loss scale (`.scale`, `.skipped_steps`), the same on every rank; None
        for another precision or before the build."""
        return self._train.pipe.loss_scale if self._train is not None else None

    @property
    def plan_report(self) -> PlanReport | None:
        """The planner's choice (table, alternatives, JSON) and, after the first steps, the
        measured-vs-predicted check; None when the layout was given (layers_per_stage)."""
        self._built()
        return self._loop.report if self._loop is not None else None

    def _built(self) -> StepRunner:
        if self._train is None:
            raise PlaitError(
                "the plan is made when the model first sees data: call fit, train_on_batch, "
                "evaluate or predict (or build(x_sample)) first"
            )
        return self._train

    def build(self, x_sample: Any) -> Plan:
        """Capture and split the model on a sample input without training; returns the plan."""
        self._runner(x_sample, train=True)
        return self.plan

    # -- one global batch ------------------------------------------------------------------------

    def _run(self, x: Any, y: Any, train: bool, keep_outputs: bool, where: str = "") -> tuple[list[float], Any, bool]:
        """Run one global batch (or a replica's `Share` of it) on every replica: the sums of loss and
        metrics over it (the same on every rank), this rank's last-stage outputs, whether the step skipped."""
        runner = self._runner(x, train, y)
        if train:
            if self.loss is None or self.optimizer is None:
                missing = "loss" if self.loss is None else "optimizer"
                raise ConfigError(f"training needs a {missing}: pass {missing}=... to plait.Model")
            self._checkpoints.apply_pending(runner.pipe, self.optimizer)
            self._load_scheduler()
            if self._loop is not None:
                self._loop.before_step(runner.pipe.interpreter, self.step + 1)
        result = runner.run(x, y, keep_outputs, self.step, self.optimizer if train else None, where)
        if train:
            self.step += 1
            if self.lr_scheduler is not None and self.step % self.config.accumulate_steps == 0:
                self.lr_scheduler.step()  # every rank, once per optimizer step
            if self._loop is not None and not self._loop.done:
                replanned = self._loop.after_step(runner.pipe.interpreter, self.step)
                if replanned is not None:
                    self._relayout(replanned, x)
        return result.sums, result.outputs, result.skipped

    def _relayout(self, report: PlanReport, x: Any) -> None:
        """Move the model to the replanned layout: save -> rebuild -> restore (checkpoint machinery)."""
        assert self._train is not None
        assert self._captured is not None
        assert self._layout is not None
        work = Workload(self.net, self._captured, x, optimizer=self._optimizer_arg, device=self.device)
        layout = replanned(self._layout, work, self.config, report)

        def rebuild() -> tuple[Pipeline, torch.optim.Optimizer | None]:
            self._layout = layout
            self._build(layout)
            assert self._train is not None
            return self._train.pipe, self.optimizer

        self._checkpoints.carry_over(self.step, self._train.pipe, self.optimizer, self.config, rebuild)

    def train_on_batch(self, x: Any, y: Any) -> float:
        """One optimizer step on one global batch; returns its mean loss (same on every rank)."""
        stats, _, _ = self._run(x, y, train=True, keep_outputs=False)
        return stats[0] / batching.num_rows(x)

    # -- whole data sets -----------------------------------------------------------------------

    def fit(
        self,
        x: Any,
        y: Any = None,
        epochs: int = 1,
        batch_size: int | None = None,
        shuffle: bool = True,
        verbose: int = 1,
        callbacks: Sequence[Any] = (),
    ) -> History:
        """Train for `epochs` epochs of global batches of `batch_size`; returns the History.

        With Config(checkpoint_dir=...), a model that has not trained yet first resumes from the
        latest complete checkpoint there (parameters, optimizer, RNG, data position, history),
        and checkpoints are saved every `checkpoint_every` steps and at the end.
        """
        steps = FitSteps(lambda: self._train is not None, lambda xb, yb: self._runner(xb, train=True, y=yb),
                         lambda xb, yb, where: self._run(xb, yb, True, False, where), self._save, self._restore,
                         self._checkpoints)  # the loop runs these, and reads only the model's public face
        return run_fit(self, steps, x, y, epochs, batch_size, shuffle, verbose, callbacks)

    def write_trace(self) -> str | None:
        """Write this rank's timeline to `Config.trace_dir` (fit does it at its end); returns the path.

        After a loop of train_on_batch calls, call this once. Without trace_dir it does nothing.
        """
        if self.config.trace_dir is None or self._train is None:
            return None
        return str(self._train.pipe.interpreter.tracer.write(self.config.trace_dir))

    def evaluate(self, x: Any, y: Any, batch_size: int | None = None) -> dict[str, float]:
        """Mean loss and metrics over all of x (every sample once); the same dict on every rank."""
        totals = [0.0] * num_stats(self.metrics)
        for a, b in batching.row_ranges(x, batch_size):
            stats, _, _ = self._run(batching.slice_rows(x, a, b), batching.slice_rows(y, a, b),
                                 train=False, keep_outputs=False)
            totals = [t + s for t, s in zip(totals, stats)]
        return logs_of(self.metrics, totals, batching.num_rows(x))

    def predict(self, x: Any, batch_size: int | None = None) -> Any:
        """The model's outputs for all of x, on every rank (tensor leaves joined along dim 0; a leaf
        not per row, as CLIP's logits_per_image, is a list of its values, one per micro-batch)."""
        parts: list[list[Any]] = []  # flat output leaves of each batch, in row order
        for a, b in batching.row_ranges(x, batch_size):
            _, outputs, _ = self._run(batching.slice_rows(x, a, b), None, train=False, keep_outputs=True)
            parts.append(self._runner(x, train=False).gather_outputs(outputs, b - a))
        return unflatten_output(join_parts(parts), self._runner(x, train=False).pipe.output_spec)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsplit state dict (keys, shapes and dtypes of net.state_dict()) on every rank,
        for models that fit one rank; `export` writes a larger one without gathering it.

        Every rank must call it (it gathers the stages from the ranks that run them); a rank that
        calls it alone gets a ConfigError saying so. `net.load_state_dict(state)` then makes `net`
        whole again on any rank, the parameters its stages freed included."""
        pipe = self._train.pipe if self._train is not None else None
        return gather_whole_state(self.net, pipe, self.config, self.rank, self.step)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a plain state dict (net.state_dict(), or `plait export` output) on every rank.

        Shared (tied) tensors may appear under one of their names or all. Keys or shapes that do
        not match the model raise CheckpointError listing them. Optimizer state is left as it is.
        """
        _, aliases, _ = train_state.model_index(self.net, {})
        train_state.copy_into(self.net, state, aliases, "the state dict")

    def memory_stats(self) -> dict[str, Any]:
        """This rank's parameter, buffer, gradient, optimizer and peak activation bytes, measured
        (the last training step's), with the planner's prediction of each under "predicted"
        (`plait.runtime.memory.memory_stats`)."""
        runner = self._built()
        chosen = self._loop.report.chosen if self._loop is not None else None
        return memory_stats(runner.pipe, self.net, runner.memory, state_factor(self.optimizer), chosen)

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str] | None = None) -> str:
        """Save a checkpoint of this step under `directory` (default: Config.checkpoint_dir).

        Call it on every rank: each writes its own shard, and the checkpoint becomes visible
        (as `directory/step-NNNNNN`, named by `directory/latest`) once all are on disk.
        """
        root = directory if directory is not None else self.config.checkpoint_dir
        if root is None:
            raise ConfigError("model.save() needs a directory: model.save('ckpt') or Config(checkpoint_dir=...)")
        return str(self._save(root, None))

    def _save(self, root: str | os.PathLike[str], data: dict[str, Any] | None) -> Path:
        k = self.config.accumulate_steps
        if self.step % k:
            raise CheckpointError(f"step {self.step} is inside an accumulation of accumulate_steps={k} batches: "
                                  "its summed gradients are in no checkpoint; save after a multiple of "
                                  f"{k} steps (model.step % {k} == 0)")
        pipe = self._train.pipe if self._train is not None else None
        scheduler = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return self._checkpoints.save(root, self.step, pipe, self.optimizer, self.config, data,
                                      {"lr_scheduler": scheduler})

    def export(self, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> str:
        """Write the weights as Hugging Face sharded safetensors (`from_pretrained` reads them):
        each rank its own tensors, rank 0 the index once all are written. Call it on every rank.
        `dtype` (e.g. torch.bfloat16): the floating tensors written in it; None: as held (the
        fp32 masters of a low-precision run)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"export(dtype=...) takes a floating torch dtype such as torch.bfloat16, got {dtype!r}")
        pipe = self._train.pipe if self._train is not None else None
        return export_weights(self.net, pipe, self.rank, self.world_size, directory, dtype)

    def load(self, path: str | os.PathLike[str]) -> int:
        """Load a checkpoint, weights or a plain state-dict file, on every rank; returns its step.

        `path` is a checkpoint directory (its latest complete checkpoint, else the previous
        one), one `step-NNNNNN` directory, or a file (`.safetensors`, or torch.save output read
        with weights_only=True). A checkpoint restores the parameters, the optimizer state of
        this rank's parameters (whatever layout saved it) and, with the same layout, the RNGs.
        Weights by name (a `.safetensors` file; a directory of `save_pretrained`, sharded or not)
        set the parameters and buffers alone: after `build`, each rank reads only its stages'
        tensors; before it, every rank reads them all (the step stays as it is).
        """
        if weights.holds_weights(path):  # never a plait checkpoint directory: those come first
            self._checkpoints.load_weights(path, self._train.pipe if self._train is not None else None)
        elif Path(path).is_file():
            self.load_state_dict(checkpoint.read_plain(path))
        else:
            self._restore(self._checkpoints.find(path))
        return self.step

    def _load_scheduler(self) -> None:
        """A restored checkpoint's learning-rate schedule, once the scheduler exists."""
        if self._scheduler_state is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(self._scheduler_state)
            self._scheduler_state = None

    def _restore(self, ckpt: checkpoint.Checkpoint) -> None:
        self._scheduler_state = ckpt.meta.get("lr_scheduler")
        pipe = self._train.pipe if self._train is not None else None
        self._checkpoints.restore(ckpt, pipe, self.optimizer)
        if self._checkpoints.pending is None:  # restored now (built): its schedule too
            self._load_scheduler()
        self.step = ckpt.step

