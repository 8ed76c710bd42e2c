"""`ModelCheckpoints`: a model's checkpoints — saving this step, restoring one, and moving to a new layout.

The parameters of a restored checkpoint are copied into the net at once; the optimizer state of
this rank's parameters and the RNG states wait (`pending`) until the pipeline and its optimizer
exist, since which parameters a rank trains depends on the layout. Moving a running model to a
new layout (a replan) is the same machinery, which loads any layout by name:

    save a checkpoint of the old layout (each rank its own parameters and optimizer state)
    -> rebuild the pipeline for the new layout (a fresh optimizer over its local parameters)
    -> restore it: every parameter, and each rank's optimizer state for its new parameters

Named weights (a .safetensors file, a Hugging Face directory: `weights`) load into the parameters
alone, each rank reading only the tensors of its own stages once the pipeline is built.

The scratch checkpoint of such a move is written under Config.checkpoint_dir (in `.replan/`, not
a resumable step) or in a temporary directory, and deleted after.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

from plait.checkpoint import train_state, weights
from plait.checkpoint.checkpointer import Checkpointer
from plait.checkpoint.disk import Checkpoint
from plait.checkpoint.parts import read_parameters
from plait.checkpoint.weights import Rows
from plait.config import Config
from plait.errors import CheckpointError
from plait.materialize import on_meta
from plait.runtime.agree import agree
from plait.runtime.comm.collectives import failed_ranks, sum_floats

if TYPE_CHECKING:
    from plait.runtime.pipeline import Pipeline

__all__ = ["ModelCheckpoints"]

log = logging.getLogger("plait")

Rebuild = Callable[[], tuple["Pipeline", "torch.optim.Optimizer | None"]]


class ModelCheckpoints:
    """Saves and restores one model's training state on this rank, in step with the others."""

    def __init__(self, net: nn.Module, rank: int, world_size: int, timeout_s: float) -> None:
        self.net, self.rank, self.world_size = net, rank, world_size
        self.checkpointer = Checkpointer(rank, world_size, timeout_s)
        self.pending: Checkpoint | None = None  # optimizer/RNG state awaiting the pipeline
        self.saved_step: int | None = None  # the step of the last checkpoint saved or loaded

    @property
    def resumed_plan(self) -> dict[str, Any] | None:
        """The plan of a restored checkpoint whose state still waits for the pipeline."""
        return self.pending.meta.get("plan") if self.pending is not None else None

    def choose(self, root: str | os.PathLike[str]) -> Checkpoint | None:
        """The checkpoint to load under `root` (the same on every rank), or None."""
        return self.checkpointer.choose(root)

    def find(self, path: str | os.PathLike[str]) -> Checkpoint:
        """The checkpoint `path` names (a directory of checkpoints, or one step's); an error if none."""
        found = self.choose(path)
        if found is None:
            raise CheckpointError(f"{path} holds no complete plait checkpoint (no step-*/ with a valid meta.json)")
        return found

    def save(self, root: str | os.PathLike[str], step: int, pipe: Pipeline | None,
             optimizer: torch.optim.Optimizer | None, config: Config, data: dict[str, Any] | None,
             extra: dict[str, Any] | None = None) -> Path:
        """Write this rank's shard of step `step`; returns the checkpoint's path once complete.
        `extra`: more of the training state, as JSON (the learning-rate schedule)."""
        for key, value in (extra or {}).items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"the {key} state cannot be saved as JSON ({e}); use a scheduler whose "
                                      "state_dict() holds numbers, strings and lists") from None
        # zero=3: each replica saves its rows of its stage's parameters and their state, split as tp's
        # parts are; beside tp, the rows gathered into tp's parts, which the first replica saves
        rows: Any = pipe.sharded if pipe is not None else None
        if pipe is not None and pipe.sharded is not None and pipe.plan.tp > 1:
            rows = pipe.sharded.whole_rows(optimizer)
        parts = {**pipe.tp_parts, **(pipe.shard_parts() if pipe.plan.tp == 1 else {})} if pipe else None
        shard = train_state.snapshot(self.net, pipe.owner_of if pipe else {}, self.rank, optimizer, parts, rows)

        def meta() -> dict[str, Any]:
            plan = json.loads(pipe.plan.to_json()) if pipe is not None else None
            scale = pipe.loss_scale.state_dict() if pipe is not None and pipe.loss_scale is not None else None
            return {"step": step, "world_size": self.world_size, "plan": plan, "config": config.to_dict(),
                    **shard.index, "data": data, "torch": torch.__version__, "loss_scale": scale, **(extra or {})}

        path = self.checkpointer.save(root, step, shard.tensors, shard.metadata, meta, config.checkpoint_keep)
        self.saved_step = step
        return path

    def restore(self, ckpt: Checkpoint, pipe: Pipeline | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Restore the checkpoint with `apply_pending`: at once when the pipeline exists, else once
        it is built (each rank then holds only its stages' tensors, and reads only those)."""
        train_state.check_saved(self.net, _shapes(ckpt), ckpt.meta["aliases"],
                                f"checkpoint {ckpt.path}")  # now, not at the build
        self.saved_step = ckpt.step
        self.pending = ckpt
        if pipe is not None:
            self.apply_pending(pipe, optimizer)
        elif not on_meta(self.net):  # a real model not built yet is whole here: its values now, for
            self._copy_values(ckpt)  # a state_dict() before any step (the build copies its own again)

    def apply_pending(self, pipe: Pipeline, optimizer: torch.optim.Optimizer | None) -> None:
        """The pending checkpoint's values of the tensors this rank holds (read from the shards
        that have them), the optimizer state of its parameters and, with the same layout, its
        RNG states."""
        ckpt, self.pending = self.pending, None
        if ckpt is None:
            return
        rows = _own_rows(pipe)  # zero=3: each replica reads its rows into its shards
        self._copy_values(ckpt, rows)
        same_layout = ckpt.same_layout(json.loads(pipe.plan.to_json()))
        stepped = [p for p in pipe.local_parameters if pipe.zero is None or pipe.zero.owned(p)]  # ZeRO: its share
        train_state.restore(ckpt, self.net, optimizer, stepped, self.rank, same_layout, pipe.sharded)
        if pipe.loss_scale is not None and ckpt.meta.get("loss_scale"):  # fp16 resumes with its scale
            pipe.loss_scale.load_state_dict(ckpt.meta["loss_scale"])
        if not same_layout and self.rank == 0:
            log.info("plait: %s was saved with another layout: RNG states not restored", ckpt.path)

    def _copy_values(self, ckpt: Checkpoint, rows: Mapping[int, Rows] | None = None) -> None:
        """The checkpoint's values of the tensors this rank holds (not on meta), read from the
        shards that have them; `rows` (zero=3, see `_own_rows`): of those, only the rows each
        shard keeps, read into it."""
        aliases = ckpt.meta["aliases"]
        state = self.net.state_dict(keep_vars=True)
        held = [aliases.get(n, n) for n, t in state.items() if not t.is_meta]
        spans = {aliases.get(n, n): (own[1].start, own[1].stop) for n, t in state.items()
                 if (own := (rows or {}).get(id(t))) is not None}
        train_state.copy_into(self.net, read_parameters(ckpt, held, spans), aliases, f"checkpoint {ckpt.path}",
                              _shapes(ckpt), rows)

    def load_weights(self, path: str | os.PathLike[str], pipe: Pipeline | None) -> weights.Loaded:
        """Copy the named weights at `path` (`weights`) into the net, in step with every rank.

        With the pipeline built, this rank reads only the tensors its stages use, and rank 0 also
        those no stage uses: each tensor's value on any other rank is never used (`state_dict()`
        and checkpoints take it from the rank that trains it, `owner_of`). Before the pipeline
        exists there is no split yet, and every rank reads every tensor.
        """
        state = self.net.state_dict(keep_vars=True)
        wanted = None
        if pipe is not None:
            held = {id(t) for s in pipe.executors for t in [*pipe.stages[s].module.parameters(),
                                                            *pipe.stages[s].module.buffers()]}
            wanted = [n for n, t in state.items() if id(t) in held or pipe.owner_of.get(id(t), 0) == self.rank]
        elif any(t.device.type == "meta" for t in state.values()):
            raise CheckpointError(f"loading {path} into a model on the meta device before it is built: call "
                                  f"model.build(x_sample) first, then model.load (each rank then reads its stages')")
        loaded, error = None, None
        try:  # zero=3: each replica reads its rows into its shards
            rows = _own_rows(pipe)
            loaded = weights.load_weights(path, state, wanted, rows)
        except Exception as e:  # noqa: BLE001 - the others must hear of it, not wait for this rank
            error = e
        failed = failed_ranks(error is not None)
        if failed and error is None:
            raise CheckpointError(f"ranks {failed} could not load the weights at {path} (see their "
                                  f"errors); this rank loaded its share")
        if error is not None:
            raise error
        assert loaded is not None
        log.info("plait: rank %d loaded %d tensors from %d files of %s", self.rank, len(loaded.read),
                 len(loaded.files), path)
        if loaded.ignored and self.rank == 0:
            log.warning("plait: %s: ignored %d names the model does not have: %s", path, len(loaded.ignored),
                        ", ".join(loaded.ignored[:10]) + (", ..." if len(loaded.ignored) > 10 else ""))
        return loaded

    def carry_over(self, step: int, pipe: Pipeline, optimizer: torch.optim.Optimizer | None,
                   config: Config, rebuild: Rebuild) -> None:
        """Move the training state to the layout `rebuild()` makes (see the module's picture).

        Parameters and optimizer state go on exactly as they were; the scratch checkpoint is not
        one of the run's (`saved_step` is kept) and is deleted after.
        """
        if config.checkpoint_dir is not None:
            scratch = str(Path(config.checkpoint_dir) / ".replan")
        else:  # rank 0 names it; one node (or a path every rank sees)
            scratch = agree(self.rank, lambda: tempfile.mkdtemp(prefix="plait-replan-"), "replan directory", 60.0)
        saved_step = self.saved_step
        try:
            path = self.save(scratch, step, pipe, optimizer, config, None)
            found = self.choose(path)
            assert found is not None
            new_pipe, new_optimizer = rebuild()
            self.restore(found, new_pipe, new_optimizer)
            self.saved_step = saved_step
            if self.world_size > 1:
                sum_floats([0.0])  # every rank has read the checkpoint before it goes
        finally:
            if self.rank == 0:
                shutil.rmtree(scratch, ignore_errors=True)


def _own_rows(pipe: Pipeline | None) -> dict[int, Rows] | None:
    """zero=3: id(the user's parameter) -> (this replica's rows of it, the whole's rows to read for
    them), what a load reads into the shards directly; else None."""
    return pipe.sharded.own_rows() if pipe is not None and pipe.sharded is not None else None


def _shapes(ckpt: Checkpoint) -> dict[str, Any]:
    """Each saved tensor's whole shape from meta.json, or an error naming the entry that lacks one."""
    shapes = {}
    for name, entry in ckpt.meta["tensors"].items():
        shape = entry.get("shape")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CheckpointError(f"{ckpt.path}/meta.json: tensor {name!r} has no valid shape ({shape!r}); "
                                  "the checkpoint is damaged: load an earlier one")
        shapes[name] = shape
    return shapes
