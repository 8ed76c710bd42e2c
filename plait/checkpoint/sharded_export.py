"""Writing a model's weights in Hugging Face's sharded safetensors format, each rank its own tensors.

No rank gathers the model: each rank writes the tensors it owns (the ones a checkpoint has it
save: `train_state.model_index`) to its own shard, and rank 0 writes the index once every shard
is on disk, so a reader that finds the index finds every file it names::

    out/model-00001-of-00002.safetensors     rank 0's tensors (stage 0)
    out/model-00002-of-00002.safetensors     rank 1's tensors (stage 1)
    out/model.safetensors.index.json         {"metadata": {"total_size": ...}, "weight_map": {name: file}}
    out/config.json                          a Hugging Face model's config, as save_pretrained writes it

A tensor split over a tp group is gathered to its first rank, which writes it whole. A tensor
shared under several names (a tied head) is written once, under its first name, as
`save_pretrained` does; `from_pretrained` and `plait.Model.load` tie it again. With one shard
the file is `model.safetensors` and there is no index.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from plait.checkpoint.disk import write_atomic, write_tensor_file
from plait.checkpoint.train_state import model_index, owned_tensors
from plait.checkpoint.weights import INDEX, SINGLE
from plait.errors import CheckpointError
from plait.tensor_parts import whole_shape

__all__ = ["shard_files", "write_own_shard", "write_index", "model_bytes", "available_bytes"]


def shard_files(entries: Mapping[str, Mapping[str, Any]]) -> dict[int, str]:
    """rank -> its shard's file name, for the ranks that own a tensor (the same on every rank)."""
    ranks = sorted({int(e["shard"]) for e in entries.values()})
    if len(ranks) == 1:
        return {ranks[0]: SINGLE}
    return {r: f"model-{i + 1:05d}-of-{len(ranks):05d}.safetensors" for i, r in enumerate(ranks)}


def write_own_shard(net: nn.Module, owner_of: Mapping[int, int], rank: int, out: str | os.PathLike[str],
                    wholes: Mapping[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write this rank's shard (if it owns any tensor); return the index's weight map and size.

    `wholes`: the whole values, by first name, of the tensors this rank owns that are split over
    a tp group (gathered from its parts: `gather_parts_to_first`); the file holds them whole.
    `dtype`: the floating tensors written in it (None: as held)."""
    _, _, entries = model_index(net, owner_of)
    files = shard_files(entries)
    mine = {**owned_tensors(net, entries, rank), **(wholes or {})}
    if dtype is not None:
        mine = {name: t.to(dtype) if t.is_floating_point() and not t.is_meta else t for name, t in mine.items()}
    on_meta = sorted(name for name, t in mine.items() if t.is_meta)
    if on_meta:
        raise CheckpointError(
            f"rank {rank} owns tensors that were never materialized (no stage uses them): {on_meta[:10]}; "
            "load weights for them (model.load) or drop them from the model before exporting"
        )
    Path(out).mkdir(parents=True, exist_ok=True)
    if mine:
        write_tensor_file(Path(out) / files[rank], mine, {"format": "pt"})
    weight_map = {name: files[int(e["shard"])] for name, e in entries.items()}
    return {"weight_map": weight_map, "total_size": model_bytes(net, dtype), "single": len(files) == 1}


def write_index(out: str | os.PathLike[str], written: Mapping[str, Any], net: nn.Module) -> None:
    """Rank 0, after every shard is written: a Hugging Face model's `config.json` (as
    `save_pretrained` writes it), then the index naming each tensor's file."""
    save_config = getattr(getattr(net, "config", None), "save_pretrained", None)
    if callable(save_config):
        save_config(out)
    if written["single"]:
        return
    index = {"metadata": {"total_size": written["total_size"]}, "weight_map": written["weight_map"]}
    write_atomic(Path(out) / INDEX, json.dumps(index, indent=2, sort_keys=True).encode())


def model_bytes(net: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the model's tensors, each shared one once (meta tensors counted by their shape,
    a tensor split over tp ranks by its whole shape; floating ones in `dtype`, where given)."""
    seen = {id(t): t for t in net.state_dict(keep_vars=True).values()}
    size = {id(t): dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
            for t in seen.values()}
    return sum(math.prod(whole_shape(t)) * size[i] for i, t in seen.items())


def available_bytes() -> float:
    """This machine's available memory (Linux: MemAvailable), or infinity where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")
