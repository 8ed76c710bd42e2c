"""Tests for plait.checkpoint.parts: a saved tensor's parts, and a replica's rows read from only the parts that hold them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.checkpoint import disk, parts, tensorfile
from plait.tensor_parts import local_part

WHOLE = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)  # 7 rows: cut unevenly in two (4 + 3)


def commit(root: Path, pieces: list[dict[str, torch.Tensor]], tensors: dict) -> disk.Checkpoint:
    temp = disk.temp_dir(root, 1, "t0")
    described = []
    for rank, piece in enumerate(pieces):
        size, digest = disk.write_shard(temp, rank, piece, {"plait": "{}"})
        described.append({"file": f"rank{rank}.safetensors", "bytes": size, "sha256": digest})
    meta = {"step": 1, "state_keys": sorted(tensors), "aliases": {}, "plan": None, "shards": described, "tensors": tensors}
    return disk.open_checkpoint(disk.commit(root, temp, 1, meta, 2), verify=True)


LAYOUTS = {  # split in meta.json, each shard's part
    "whole on shard 1": (None, lambda: [{}, {"w": WHOLE}]),
    "rows in 2 parts": ({"dim": 0, "blocks": 1, "shards": [0, 1]}, lambda: [{"w": WHOLE[:4]}, {"w": WHOLE[4:]}]),
    "columns in 2 parts": ({"dim": 1, "blocks": 1, "shards": [0, 1]}, lambda: [{"w": WHOLE[:, :3]}, {"w": WHOLE[:, 3:]}]),
    "3 blocks of columns": ({"dim": 1, "blocks": 3, "shards": [0, 1]},
                            lambda: [{"w": local_part(WHOLE, 1, 3, r, 2).contiguous()} for r in range(2)]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rows", [(0, 4), (4, 7), (2, 6), (3, 3)])
def test_a_replicas_rows_of_any_saved_layout_are_the_wholes_rows(tmp_path, monkeypatch, layout, rows):
    split, pieces = LAYOUTS[layout]
    entry = {"shard": 1 if split is None else 0, "shape": [7, 6], "dtype": "torch.float32", **({"split": split} if split else {})}
    ckpt = commit(tmp_path, pieces(), {"w": entry})
    read = []
    plain = tensorfile.read_tensors

    def counted(*args, **kwargs):
        tensors, metadata = plain(*args, **kwargs)
        read.extend(t.numel() for t in tensors.values())
        return tensors, metadata

    monkeypatch.setattr(tensorfile, "read_tensors", counted)
    got = parts.read_parameters(ckpt, ["w"], {"w": rows})["w"]
    assert torch.equal(got, WHOLE[rows[0]:rows[1]]), (got, rows)
    assert sum(read) == (rows[1] - rows[0]) * 6  # those rows alone were read, from whichever parts hold them
    assert torch.equal(parts.read_parameters(ckpt, ["w"])["w"], WHOLE)


def test_parts_of_several_blocks_along_dim_0_are_read_whole_then_cut(tmp_path):
    whole = torch.arange(6 * 2, dtype=torch.float32).reshape(6, 2)
    split = {"dim": 0, "blocks": 3, "shards": [0, 1]}
    ckpt = commit(tmp_path, [{"w": local_part(whole, 0, 3, r, 2).contiguous()} for r in range(2)],
                  {"w": {"shard": 0, "shape": [6, 2], "dtype": "torch.float32", "split": split}})
    assert parts.part_rows_of(ckpt.meta["tensors"]["w"], (1, 4)) == {0: True, 1: True}
    assert torch.equal(parts.read_parameters(ckpt, None, {"w": (1, 4)})["w"], whole[1:4])


def test_part_rows_of_names_only_the_overlapping_parts():
    entry = {"shard": 0, "shape": [7, 6], "split": {"dim": 0, "blocks": 1, "shards": [3, 5]}}
    assert parts.part_rows_of(entry, (2, 6)) == {3: (2, 4), 5: (0, 2)}
    assert parts.part_rows_of(entry, (5, 7)) == {5: (1, 3)}
    assert parts.part_rows_of(entry, None) == {3: True, 5: True}
