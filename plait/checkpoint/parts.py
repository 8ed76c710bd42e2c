"""The parts of a saved tensor: which shards hold it, which of their rows to read, and the tensor joined from them.

A checkpoint's index (meta.json) gives each tensor its shard, or its "split": the dimension and blocks
it was cut along and the shard of each part (tp's parts, zero=3's rows). A rank reads what it keeps:
the whole tensor, or (zero=3) the rows its replica holds, from the parts that have them; `export`
writes a checkpoint's whole model as one plain file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from plait.checkpoint import tensorfile
from plait.checkpoint.disk import Checkpoint, find_resumable, open_checkpoint
from plait.errors import CheckpointError
from plait.tensor_parts import part_rows, whole_of

__all__ = ["holders", "join_parts", "join_rows", "join_state", "part_rows_of", "shard_reads", "read_parameters",
           "export"]


def holders(entry: Mapping[str, Any]) -> list[int]:
    """The ranks whose shards hold (a part of) the tensor of an index entry."""
    split = entry.get("split")
    return [int(r) for r in split["shards"]] if split else [int(entry["shard"])]


def join_parts(entry: Mapping[str, Any], values: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The whole tensor of an index entry from its value in each holder's shard (rank -> tensor)."""
    split = entry.get("split")
    if not split:
        return values[int(entry["shard"])]
    return whole_of([values[int(r)] for r in split["shards"]], int(split["dim"]), int(split["blocks"]))


def read_parameters(ckpt: Checkpoint, names: Iterable[str] | None = None,
                    rows: Mapping[str, tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """The model tensors (parameters and buffers, aliases not repeated) of a checkpoint by name:
    all, or those of `names` (first names, as meta.json lists them), reading only their shards.
    A tensor saved split over tp ranks is joined whole from its parts. `rows` (name -> [start, stop)
    along dim 0 of the whole: a zero=3 replica's): only those rows of it are read, from the parts
    that hold them."""
    entries = ckpt.meta["tensors"]
    chosen = set(entries) if names is None else set(names) & set(entries)
    wanted = shard_reads(entries, chosen, rows or {})
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for rank in sorted(wanted):
        these = wanted[rank]
        tensors, _ = ckpt.read_shard(rank, lambda name: these.get(name, False))
        for name in wanted[rank]:
            if name not in tensors:
                raise CheckpointError(f"{ckpt.shard_path(rank)} lacks {name!r}, which meta.json places there")
            pieces.setdefault(name, {})[rank] = tensors[name]
    return {name: join_rows(entries[name], pieces[name], (rows or {}).get(name)) for name in entries if name in chosen}


def shard_reads(entries: Mapping[str, Mapping[str, Any]], names: Iterable[str],
                rows: Mapping[str, tuple[int, int]]) -> dict[int, dict[str, tuple[int, int] | bool]]:
    """What to read of each shard for the tensors `names` of a checkpoint's index: shard -> tensor ->
    its whole part (True) or rows of it (`part_rows_of`), the whole's `rows` where given."""
    wanted: dict[int, dict[str, tuple[int, int] | bool]] = {}
    for name in names:
        for rank, part in part_rows_of(entries[name], rows.get(name)).items():
            wanted.setdefault(rank, {})[name] = part
    return wanted


def part_rows_of(entry: Mapping[str, Any], rows: tuple[int, int] | None) -> dict[int, tuple[int, int] | bool]:
    """For each shard holding (a part of) an index entry's tensor, the rows of its part to read for
    rows [start, stop) of the whole (True: the whole part; `rows` None: the whole tensor). Parts cut along dim 0
    in one block hold consecutive rows (`tensor_parts.part_rows`): only those overlapping are read;
    parts cut along another dimension hold every row: each gives those rows; parts of several blocks
    are read whole."""
    split = entry.get("split")
    if rows is None or not split:
        return {r: True if rows is None else rows for r in holders(entry)}
    ranks = [int(r) for r in split["shards"]]
    if int(split["dim"]) != 0:
        return {r: rows for r in ranks}
    if int(split["blocks"]) != 1:
        return {r: True for r in ranks}
    start, stop = rows
    out: dict[int, tuple[int, int] | bool] = {}
    for i, r in enumerate(ranks):
        first, last = part_rows(int(entry["shape"][0]), i, len(ranks))
        if max(first, start) < min(last, stop):
            out[r] = (max(first, start) - first, min(last, stop) - first)
    return out or {ranks[0]: (0, 0)}  # (no rows: an empty tensor of the part's kind)


def join_rows(entry: Mapping[str, Any], values: Mapping[int, torch.Tensor], rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows [start, stop) of an index entry's tensor (None: all of it) from what `part_rows_of` read."""
    split = entry.get("split")
    if rows is None or not split:  # (not split: the one shard's value is what it read)
        return join_parts(entry, values)
    ranks = [int(r) for r in split["shards"]]
    if int(split["dim"]) != 0:
        return whole_of([values[r] for r in ranks], int(split["dim"]), int(split["blocks"]))
    if int(split["blocks"]) != 1:
        return join_parts(entry, values)[rows[0]:rows[1]]
    return torch.cat([values[r] for r in ranks if r in values], 0)


def join_state(entry: Mapping[str, Any], values: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """One optimizer tensor of a parameter from the shards holding it: the parts of a split
    parameter's state (a tensor of its part's shape) joined; otherwise any one (a step count)."""
    split, any_one = entry.get("split"), next(iter(values.values()))
    if not split or set(values) != set(split["shards"]):
        return any_one
    shape, dim = entry["shape"], int(split["dim"])
    if any_one.dim() != len(shape) or sum(v.shape[dim] for v in values.values()) != shape[dim]:
        return any_one
    return join_parts(entry, values)


def export(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Checkpoint:
    """Write the model's plain state dict (the names and order of net.state_dict()) to `out`.

    `source` is a checkpoint directory (its latest complete checkpoint) or one step directory.
    `out` ending in .safetensors is written in that format; anything else with torch.save,
    which `net.load_state_dict(torch.load(out, weights_only=True))` accepts.
    """
    source = Path(source)
    if (source / "meta.json").exists():
        ckpt = open_checkpoint(source, verify=True)
    else:
        found = find_resumable(source)
        if found is None:
            raise CheckpointError(f"{source} holds no complete plait checkpoint (no step-*/ with a valid meta.json)")
        ckpt = found
    values = read_parameters(ckpt)
    state = {name: values[ckpt.meta["aliases"].get(name, name)] for name in ckpt.meta["state_keys"]}
    out = Path(out)
    part = out.with_name(out.name + ".part")
    with open(part, "wb") as f:
        if out.suffix == ".safetensors":
            tensorfile.write_tensors(f, state, {"format": "pt"})
        else:
            torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, out)
    return ckpt
