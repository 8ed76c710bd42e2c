"""A trained net's weights whole: the state dict gathered on every rank, and the sharded safetensors export."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from plait.checkpoint.sharded_export import available_bytes, model_bytes, write_index, write_own_shard
from plait.config import Config
from plait.errors import CheckpointError
from plait.job.together import meet
from plait.runtime.comm.collectives import failed_ranks, gather_state_dict, sum_floats, whole_split_tensors
from plait.runtime.failure import failure_error
from plait.runtime.pipeline import Pipeline

__all__ = ["gather_whole_state", "export_weights"]


def gather_whole_state(net: nn.Module, pipe: Pipeline | None, config: Config, rank: int, step: int) -> dict[str, torch.Tensor]:
    """`model.state_dict()`: the whole state dict on every rank, gathered from the ranks that run
    each stage (`pipe`: this rank's, None before the build); refused on every rank where one rank's
    memory limit is under the whole model."""
    owners = pipe.owner_of if pipe is not None else {}
    parts = pipe.tp_parts if pipe is not None else {}
    meet("model.state_dict()", "Call it on every rank and save on one: state = model.state_dict(), "
         "then if model.rank == 0: torch.save(state, path)", config.timeout_s)
    whole, limit = model_bytes(net), config.memory_limit_bytes or available_bytes()
    over = failed_ranks(whole > limit)  # every rank refuses if one must, none waits in the gather
    if over:
        raise CheckpointError(
            f"state_dict() would hold the whole model ({whole / 2**30:.2f} GiB) on every rank, over "
            f"the limit of ranks {over} (this rank's: {limit / 2**30:.2f} GiB); write it with "
            "model.export(directory) (each rank its own tensors) or save a sharded checkpoint with model.save()")
    try:
        with _whole(pipe):  # zero=3: the shards gathered into the user's parameters
            return gather_state_dict(net, owners, parts)
    except Exception as e:  # noqa: BLE001 - a peer died or timed out: name it
        raise failure_error(f"gathering the state dict after step {step}", rank, e, config.timeout_s) from e


def export_weights(net: nn.Module, pipe: Pipeline | None, rank: int, world_size: int,
                   directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> str:
    """`model.export(directory)`: Hugging Face sharded safetensors, each rank its own tensors (floating
    ones in `dtype`, where given), rank 0 the index once all are written; every rank returns once
    the index is written."""
    try:
        with _whole(pipe):  # zero=3: the shards gathered into the user's parameters (tp's parts, with tp)
            # a tensor split over tp ranks is written whole by the first of them
            wholes = whole_split_tensors(net, pipe.tp_parts, pipe.tp_group) if pipe and pipe.tp_parts else {}
            written, error = write_own_shard(net, pipe.owner_of if pipe else {}, rank, directory, wholes, dtype), ""
    except (CheckpointError, OSError) as e:
        written, error = {}, f"{type(e).__name__}: {e}"
    failed = failed_ranks(bool(error))
    if failed:
        raise CheckpointError(error or f"ranks {failed} could not write their shard of {directory}")
    if rank == 0:
        write_index(directory, written, net)
    if world_size > 1:
        sum_floats([0.0])  # the index is written before any rank returns
    return str(directory)


def _whole(pipe: Pipeline | None) -> contextlib.AbstractContextManager[None]:
    """The user's parameters whole for a `with` block (`Pipeline.whole_parameters`; before the build: as they are)."""
    return pipe.whole_parameters() if pipe is not None else contextlib.nullcontext()
