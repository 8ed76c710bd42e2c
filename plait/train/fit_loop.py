"""The fit loop: epochs of global batches, resumed from the latest checkpoint, with the checkpoint cadence."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from plait import data as batching
from plait.callbacks import History, PlanPrinter, ProgressBar, call_hooks
from plait.checkpoint.disk import Checkpoint
from plait.checkpoint.model_checkpoints import ModelCheckpoints
from plait.checkpoint.resume import ResumePoint, resume_point, resumed_line
from plait.cost.row_blocks import check_rows
from plait.errors import ConfigError
from plait.metrics import logs_of
from plait.runtime.step_sums import num_stats
from plait.train.shares import share_batches

__all__ = ["FitSteps", "FitRun", "run_fit"]

log = logging.getLogger("plait")

# `model` is the `plait.Model` that fits (typed Any: plait.model imports this module); the loop reads
# its public face (config, plan, step, rank, metrics, grad_norm) and runs the steps `FitSteps` hands over.


@dataclass(frozen=True)
class FitSteps:
    """The model's own operations the loop runs, handed over by `Model.fit`: the loop reaches into
    no private part of the model."""

    built: Callable[[], bool]  # whether the training pipeline exists yet
    build: Callable[[Any, Any], object]  # capture, plan and build on a batch (x, y), the optimizer with them
    train: Callable[[Any, Any, str], tuple[list[float], Any, bool]]  # one step on a global batch, named
    # for its errors: the batch's sums, this rank's outputs, whether the optimizer step was skipped
    save: Callable[[str, dict[str, Any]], object]  # a checkpoint under a root, with the data position
    restore: Callable[[Checkpoint], None]  # a found checkpoint into the model (built or not)
    checkpoints: ModelCheckpoints  # the model's: the step saved last, one pending, the latest under a root


@dataclass
class FitRun:
    """One call of `fit`: the model's steps, its data, order, history and callbacks."""

    steps: FitSteps
    x: Any
    y: Any
    batch_size: int | None
    shuffle: bool
    order: dict[str, Any]
    history: History
    callbacks: list[Any]

    def position(self, epoch: int, batch: int, totals: list[float] | None, rows_seen: int) -> dict[str, Any]:
        """The data position a checkpoint saves (`plait.checkpoint.resume` reads it back)."""
        return {**self.order, "epoch": epoch, "batch": batch, "totals": totals, "rows_seen": rows_seen,
                "history_epochs": self.history.epoch, "history": self.history.history}


def run_fit(model: Any, steps: FitSteps, x: Any, y: Any, epochs: int, batch_size: int | None, shuffle: bool,
            verbose: int, callbacks: Sequence[Any]) -> History:
    """`model.fit(x, y, epochs, batch_size, shuffle, verbose, callbacks)`: train, resume, checkpoint."""
    if not isinstance(epochs, int) or epochs < 0:
        raise ConfigError(f"epochs must be a non-negative integer, got {epochs!r}")
    history = History()
    batches_per_epoch = batching.count_batches(x, batch_size)
    order = batching.data_order(x, y, batch_size, shuffle, batches_per_epoch, model.config.seed)
    cbs: list[Any] = list(callbacks) + [history]
    if verbose:  # the plan is printed first, then the step's progress
        cbs.insert(0, PlanPrinter(lambda: (model.plan, model.plan_report), enabled=model.rank == 0))
        cbs.append(ProgressBar(batches_per_epoch, epochs, enabled=model.rank == 0))
    fit = FitRun(steps, x, y, batch_size, shuffle, order, history, cbs)

    # resume: a fresh model with a checkpoint_dir goes on from the latest checkpoint there
    start = _resume(model, steps, order, history, epochs, verbose)
    first = start.epoch if start else 0
    if not steps.built() and first < epochs:  # built before any hook: model.optimizer exists in them
        _build_on_first_batch(model, fit, first, start.batch if start is not None and start.epoch == first else 0)

    # epochs of global batches, a checkpoint every checkpoint_every steps and at the end
    for epoch in range(first, epochs):
        call_hooks(fit.callbacks, "on_epoch_begin", epoch, {})
        logs = _epoch(model, fit, epoch, start if start is not None and epoch == start.epoch else None)
        call_hooks(fit.callbacks, "on_epoch_end", epoch, logs)
        last = model.config.checkpoint_every is None or epoch == epochs - 1
        if model.config.checkpoint_dir is not None and last and steps.checkpoints.saved_step != model.step:
            steps.save(model.config.checkpoint_dir, fit.position(epoch + 1, 0, None, 0))
    model.write_trace()
    return history


def _build_on_first_batch(model: Any, fit: FitRun, epoch: int, skip: int) -> None:
    """Capture, plan and build on the first batch `fit` will train on (the optimizer with them)."""
    for xb, yb in batching.epoch_batches(fit.x, fit.y, fit.batch_size, fit.shuffle, model.config.seed, epoch, skip):
        fit.steps.build(xb, yb)
        break


def _resume(model: Any, steps: FitSteps, order: dict[str, Any], history: History, epochs: int,
            verbose: int) -> ResumePoint | None:
    """Restore the latest checkpoint under Config.checkpoint_dir into a fresh model; where to go on."""
    root = model.config.checkpoint_dir
    if root is None or model.step != 0 or steps.checkpoints.pending is not None:
        return None
    found = steps.checkpoints.choose(root)
    if found is None:
        return None
    start = resume_point(found, order)
    steps.restore(found)
    history.epoch, history.history = start.history_epochs, start.history
    if model.rank == 0 and verbose:
        print(resumed_line(found, start, epochs), file=sys.stderr, flush=True)
    elif model.rank == 0:
        log.info("%s", resumed_line(found, start, epochs))
    return start


def _epoch(model: Any, fit: FitRun, epoch: int, start: ResumePoint | None) -> dict[str, float]:
    """One epoch's steps (from a resumed position inside it, if `start`); its logs."""
    totals, rows_seen, skip = [0.0] * num_stats(model.metrics), 0, 0
    if start is not None and start.totals is not None:
        totals, rows_seen, skip = list(start.totals), start.rows_seen, start.batch
    for step, (xb, yb) in enumerate(_batches(model, fit, epoch, skip), start=skip):
        if step <= skip + 1 and fit.steps.built() and model.plan.stage_dp:  # once the plan is known
            _check_batch_sizes(model, batching.batch_sizes(fit.x, fit.batch_size))
        stats, _, skipped = fit.steps.train(xb, yb, f"epoch {epoch + 1}, batch {step + 1} (training step {model.step + 1})")
        if not skipped:  # a skipped step's NaN loss stays out of the epoch's logs
            rows_seen += batching.global_rows(xb)
            totals = [t + s for t, s in zip(totals, stats)]
        logs = logs_of(model.metrics, totals, max(rows_seen, 1))
        if model.grad_norm is not None:  # Config.clip_grad_norm: this step's norm before clipping
            logs["grad_norm"] = model.grad_norm
        call_hooks(fit.callbacks, "on_batch_end", step, logs)
        every, root = model.config.checkpoint_every, model.config.checkpoint_dir
        if root is not None and every is not None and model.step % every == 0:
            fit.steps.save(root, fit.position(epoch, step + 1, totals, rows_seen))
    return logs_of(model.metrics, totals, max(rows_seen, 1))


def _batches(model: Any, fit: FitRun, epoch: int, skip: int) -> Iterator[tuple[Any, Any]]:
    """The epoch's global batches after the first `skip`: of a data set, each replica's own rows
    alone (`plait.train.shares`) once the pipeline is built, unless its stages cut rows by their
    own dp widths or it may be replanned (each reads whole batches)."""
    seed = batching.epoch_seed(model.config.seed, epoch)
    plan = model.plan if fit.steps.built() else None
    if plan is not None and plan.dp > 1 and not plan.stage_dp and not model.replanning:
        shares = share_batches(fit.x, fit.batch_size, fit.shuffle, seed, skip, plan.position_of(model.rank)[1], plan.dp)
        if shares is not None:
            return ((share, None) for share in shares)
    return batching.epoch_batches(fit.x, fit.y, fit.batch_size, fit.shuffle, model.config.seed, epoch, skip)


def _check_batch_sizes(model: Any, sizes: Sequence[int]) -> None:
    """With stage_dp, before an epoch's last batch fails mid-epoch: every batch size's micro-batches divide."""
    for size in sizes:
        for a, b in batching.microbatch_bounds(size, model.plan.num_microbatches):
            try:
                check_rows(b - a, model.plan.stage_dp, f"this epoch has a batch of {size} rows; its micro-batch {a}:{b}")
            except ConfigError as e:
                raise ConfigError(f"{e}, or drop the uneven last batch (a DataLoader with drop_last=True)") from None
