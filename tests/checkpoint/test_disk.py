"""The checkpoint directory format and its commit protocol: names, meta.json, fallback, export (one
process, no ranks)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch

from plait.checkpoint import disk, parts, tensorfile
from plait.errors import CheckpointError


def save(root: Path, step: int, shards: list[dict[str, torch.Tensor]], state_keys: list[str] | None = None,
         aliases: dict[str, str] | None = None, plan: dict | None = None, keep: int = 2,
         token: str = "t0") -> Path:
    """Commit step `step` whose rank r wrote `shards[r]`, the way the ranks and rank 0 do."""
    temp = disk.temp_dir(root, step, token)
    entries: dict[str, dict[str, int]] = {}
    described = []
    for rank, tensors in enumerate(shards):
        size, digest = disk.write_shard(temp, rank, tensors, {"plait": "{}"})
        described.append({"file": f"rank{rank}.safetensors", "bytes": size, "sha256": digest})
        entries.update({name: {"shard": rank} for name in tensors})
    meta = {"step": step, "state_keys": state_keys or list(entries), "aliases": aliases or {},
            "tensors": entries, "plan": plan, "shards": described}
    return disk.commit(root, temp, step, meta, keep)


def save_steps(root: Path, steps, keep=2):
    """Commit tiny one-shard checkpoints at `steps` the way the ranks do."""
    for step in steps:
        temp = disk.temp_dir(root, step, "t0")
        size, digest = disk.write_shard(temp, 0, {"w": torch.full((2,), float(step))}, {"plait": "{}"})
        meta = {"step": step, "state_keys": ["w"], "aliases": {}, "tensors": {"w": {"shard": 0}}, "plan": None,
                "shards": [{"file": "rank0.safetensors", "bytes": size, "sha256": digest}]}
        disk.commit(root, temp, step, meta, keep)


def test_commit_publishes_moves_latest_last_and_prunes(tmp_path):
    save_steps(tmp_path, [1, 2, 3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000003"]
    assert (tmp_path / "latest").read_text() == "step-000003\n"
    found = disk.find_resumable(tmp_path)
    assert found.step == 3 and parts.read_parameters(found)["w"].tolist() == [3.0, 3.0]
    save_steps(tmp_path, [4, 5, 6], keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000005", "step-000006"]


def test_every_file_is_fsynced_before_it_is_renamed_and_latest_moves_last(tmp_path, monkeypatch):
    # A checkpoint is durable before it is visible: each file's bytes are fsynced before the rename
    # that publishes it, each rename is followed by an fsync of its directory, and `latest` is
    # the last name to change.
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(disk.os, "fsync", fsync)
    monkeypatch.setattr(disk.os, "replace", replace)
    save_steps(tmp_path, [1])
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert len(renames) == 4, events  # shard, meta.json, the step directory, latest
    for i in renames:
        src, dst = events[i][1], events[i][2]
        if src.endswith(".part"):  # a file: its own bytes were fsynced just before
            assert events[i - 1] == ("fsync", src), (i, events)
        assert events[i + 1] == ("fsync", str(Path(dst).parent)), (i, events)  # then its directory
    assert events[renames[-1]][2] == str(tmp_path / "latest")
    assert events[renames[-2]][2] == str(tmp_path / "step-000001")


def test_unfinished_and_unpublished_checkpoints_are_never_resumed(tmp_path):
    save_steps(tmp_path, [1, 2])
    # a crash while writing step 3 (a temp dir), and one after publishing step 4 but before `latest`
    disk.write_shard(disk.temp_dir(tmp_path, 3, "t1"), 0, {"w": torch.zeros(2)}, {})
    save_steps(tmp_path / "other", [4])
    (tmp_path / "other" / "step-000004").rename(tmp_path / "step-000004")
    assert disk.find_resumable(tmp_path).step == 2
    save_steps(tmp_path, [3])  # the resumed run saves again: the orphans of the old attempt go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "other", "step-000002", "step-000003"]


@pytest.mark.parametrize("damage", ["truncate shard", "flip a byte", "delete shard", "garbage meta",
                                    "truncate meta", "garbage latest"])
def test_a_damaged_latest_falls_back_to_the_previous_complete_one(tmp_path, damage, caplog):
    save_steps(tmp_path, [1, 2])
    step2 = tmp_path / "step-000002"
    shard = step2 / "rank0.safetensors"
    if damage == "truncate shard":
        shard.write_bytes(shard.read_bytes()[:-3])
    elif damage == "flip a byte":
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0x40
        shard.write_bytes(bytes(raw))
    elif damage == "delete shard":
        shard.unlink()
    elif damage == "garbage meta":
        (step2 / "meta.json").write_bytes(b"\x00\xffnot json")
    elif damage == "truncate meta":
        (step2 / "meta.json").write_bytes((step2 / "meta.json").read_bytes()[:40])
    else:
        (tmp_path / "latest").write_bytes(b"../../etc/passwd\n")
    found = disk.find_resumable(tmp_path)
    if damage == "garbage latest":  # the pointer is ignored: the newest complete one is used
        assert found.step == 2 and "does not name a checkpoint" in caplog.text
        return
    assert found.step == 1
    assert "skipping checkpoint step-000002" in caplog.text
    with pytest.raises(CheckpointError, match=str(step2)):
        disk.open_checkpoint(step2, verify=True)


# -- names, meta.json and the Checkpoint ---------------------------------------------------------


def test_step_and_temporary_directory_names() -> None:
    assert disk.step_name(7) == "step-000007"
    assert disk.step_name(1234567) == "step-1234567"  # six digits at least, never cut
    assert disk.temp_dir("/ckpt", 12, "abc") == Path("/ckpt/step-000012.tmp-abc")


def test_write_shard_returns_the_size_and_sha256_of_the_file_it_leaves(tmp_path: Path) -> None:
    size, digest = disk.write_shard(tmp_path / "d", 3, {"w": torch.arange(4.0)}, {"plait": "{}"})
    shard = tmp_path / "d" / "rank3.safetensors"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["rank3.safetensors"]  # no .part left
    assert size == shard.stat().st_size
    assert digest == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_meta_json_is_the_format_and_the_fields_given(tmp_path: Path) -> None:
    plan = {"layers_per_stage": [1, 1], "dp": 1, "num_virtual_stages": 1, "world_size": 2}
    final = save(tmp_path, 4, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], plan=plan)
    assert final == tmp_path / "step-000004"
    meta = json.loads((final / "meta.json").read_text())
    assert meta["format"] == "plait-checkpoint-1" == disk.FORMAT
    assert (meta["step"], meta["state_keys"], meta["tensors"], meta["plan"]) == (
        4, ["a", "b"], {"a": {"shard": 0}, "b": {"shard": 1}}, plan)
    ckpt = disk.open_checkpoint(final, verify=True)
    assert (ckpt.step, ckpt.world_size, ckpt.shard_path(1)) == (4, 2, final / "rank1.safetensors")
    tensors, part = ckpt.read_shard(1)
    assert list(tensors) == ["b"] and part == {}
    assert {k: v.tolist() for k, v in parts.read_parameters(ckpt).items()} == {"a": [1.0, 1.0], "b": [0.0] * 3}


def test_same_layout_compares_the_stages_and_ranks_only(tmp_path: Path) -> None:
    plan = {"layers_per_stage": [2, 3], "dp": 1, "num_virtual_stages": 1, "world_size": 2, "schedule": "1f1b"}
    ckpt = disk.open_checkpoint(save(tmp_path, 1, [{"w": torch.ones(1)}], plan=plan))
    assert ckpt.same_layout(dict(plan, schedule="gpipe", num_microbatches=8))  # not a layout field
    for key, value in (("layers_per_stage", [3, 2]), ("dp", 2), ("num_virtual_stages", 2), ("world_size", 4),
                       ("stage_tp", [2, 1]), ("stage_dp", [1, 2])):
        assert not ckpt.same_layout(dict(plan, **{key: value})), key
    assert ckpt.same_layout(dict(plan, stage_tp=[], stage_dp=[]))  # a uniform plan's empty widths
    widths = dict(plan, world_size=3, tp=2, stage_tp=[2, 1])
    wide = disk.open_checkpoint(save(tmp_path / "widths", 1, [{"w": torch.ones(1)}] * 3, plan=widths))
    assert wide.same_layout(widths) and not wide.same_layout(dict(widths, stage_tp=[1, 2]))
    damaged = disk.open_checkpoint(save(tmp_path / "damaged", 1, [{"w": torch.ones(1)}] * 3,
                                        plan=dict(widths, stage_tp=1.5)))
    assert not damaged.same_layout(widths)  # a damaged entry is another layout, not an error
    unplanned = disk.open_checkpoint(save(tmp_path / "other", 1, [{"w": torch.ones(1)}]))
    assert not unplanned.same_layout(plan)  # saved with no plan: no layout to match


def test_open_checkpoint_without_meta_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        disk.open_checkpoint(tmp_path / "step-000001")
    assert str(info.value) == (f"{tmp_path / 'step-000001'}: no readable meta.json (No such file or "
                               f"directory); not a complete checkpoint")


def test_meta_json_that_is_not_json_is_called_damaged(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text('{"step": ')
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}/meta.json is not JSON (JSONDecodeError: ")
                       + r".*\); the file is damaged$"):
        disk.open_checkpoint(tmp_path)


def _break(meta: dict, how: str) -> None:
    if how == "format":
        meta["format"] = "plait-checkpoint-0"
    elif how == "step":
        meta["step"] = -1
    elif how == "bool step":
        meta["step"] = True
    elif how == "no shards":
        meta["shards"] = []
    elif how == "shard file":
        meta["shards"][0]["file"] = "rank1.safetensors"
    elif how == "tensor index":
        meta["tensors"]["w"]["shard"] = 5
    elif how == "state_keys":
        meta["state_keys"] = "w"
    elif how == "aliases":
        del meta["aliases"]
    elif how == "plan":
        meta["plan"] = [1, 2]
    elif how == "disagree":
        meta["state_keys"] = ["w", "ghost"]
    elif how == "alias values":
        meta["aliases"] = {"extra": 3}


@pytest.mark.parametrize("how, what", [
    ("format", "format is not 'plait-checkpoint-1'"),
    ("step", "no step number"),
    ("bool step", "no step number"),
    ("no shards", "no shards listed"),
    ("shard file", "shard 0 is described as {'file': 'rank1.safetensors', 'bytes': "),
    ("tensor index", "the tensor index is malformed"),
    ("state_keys", "state_keys must list the state dict's names"),
    ("aliases", "aliases are missing"),
    ("plan", "the plan is not a JSON object"),
    ("disagree", "state_keys, aliases and the tensor index disagree (e.g. ['ghost'])"),
    ("alias values", "aliases must map names to names"),
])
def test_a_malformed_meta_json_says_what_is_wrong(tmp_path: Path, how: str, what: str) -> None:
    final = save(tmp_path, 1, [{"w": torch.ones(2)}])
    meta = json.loads((final / "meta.json").read_text())
    _break(meta, how)
    (final / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as info:
        disk.open_checkpoint(final)
    message = str(info.value)
    assert message.startswith(f"{final}/meta.json: {what}")
    assert message.endswith("; it is not a complete plait checkpoint")


def test_verify_names_a_missing_or_resized_shard(tmp_path: Path) -> None:
    final = save(tmp_path, 1, [{"w": torch.ones(2)}])
    shard = final / "rank0.safetensors"
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0")
    ckpt = disk.open_checkpoint(final)  # meta.json alone is fine: the shards are read by verify
    with pytest.raises(CheckpointError) as info:
        ckpt.verify()
    assert str(info.value) == f"{shard}: {size + 1} bytes, meta.json recorded {size} (truncated or replaced)"
    shard.unlink()
    with pytest.raises(CheckpointError) as info:
        ckpt.verify()
    assert str(info.value) == f"{final}: shard rank0.safetensors is missing"


@pytest.mark.parametrize("text, message", [
    ("[1]", "its metadata is not a JSON object"),
    ("{", "its metadata is not JSON (Expecting property name"),
])
def test_a_shard_whose_metadata_is_not_a_json_object_is_refused(tmp_path: Path, text: str, message: str) -> None:
    final = save(tmp_path, 1, [{"w": torch.ones(2)}])
    shard = final / "rank0.safetensors"
    size, digest = disk.write_shard(final, 0, {"w": torch.ones(2)}, {"plait": text})
    meta = json.loads((final / "meta.json").read_text())
    meta["shards"][0].update(bytes=size, sha256=digest)
    (final / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as info:
        disk.open_checkpoint(final).read_shard(0)
    assert str(info.value).startswith(f"{shard}: {message}")


def test_read_parameters_names_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    temp = disk.temp_dir(tmp_path, 1, "t0")
    size, digest = disk.write_shard(temp, 0, {"v": torch.ones(1)}, {})
    meta = {"step": 1, "state_keys": ["w"], "aliases": {}, "tensors": {"w": {"shard": 0}}, "plan": None,
            "shards": [{"file": "rank0.safetensors", "bytes": size, "sha256": digest}]}
    ckpt = disk.open_checkpoint(disk.commit(tmp_path, temp, 1, meta, 2))
    with pytest.raises(CheckpointError) as info:
        parts.read_parameters(ckpt)
    assert str(info.value) == f"{ckpt.shard_path(0)} lacks 'w', which meta.json places there"


# -- commit and the search for a resumable checkpoint ---------------------------------------------


def test_keep_one_leaves_only_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save(tmp_path, step, [{"w": torch.ones(1)}], keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000003"]


def test_commit_replaces_a_step_whose_latest_never_moved(tmp_path: Path) -> None:
    save(tmp_path, 1, [{"w": torch.full((1,), 1.0)}])
    save(tmp_path, 2, [{"w": torch.full((1,), 2.0)}])
    (tmp_path / "latest").write_text("step-000001\n")  # as if the first attempt crashed before it moved
    save(tmp_path, 2, [{"w": torch.full((1,), 9.0)}], token="t9")  # the next attempt saves step 2 again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001", "step-000002"]
    found = disk.find_resumable(tmp_path)
    assert found is not None and found.step == 2 and parts.read_parameters(found)["w"].tolist() == [9.0]


def test_nothing_to_resume_in_a_missing_or_empty_directory(tmp_path: Path) -> None:
    assert disk.find_resumable(tmp_path / "absent") is None
    assert disk.find_resumable(tmp_path) is None
    (tmp_path / "step-000001.tmp-x").mkdir()  # only an unfinished attempt
    assert disk.find_resumable(tmp_path) is None


def test_latest_naming_a_step_skips_newer_orphans(tmp_path: Path) -> None:
    save(tmp_path, 1, [{"w": torch.full((1,), 1.0)}], keep=3)
    save(tmp_path, 2, [{"w": torch.full((1,), 2.0)}], keep=3)
    (tmp_path / "latest").write_text("step-000001\n")
    assert disk.find_resumable(tmp_path).step == 1  # step 2 is newer than what latest names


# -- export and plain state dicts ---------------------------------------------------------------


def test_export_writes_the_state_dict_in_its_order_with_tied_names(tmp_path: Path) -> None:
    w, b = torch.arange(6.0).reshape(2, 3), torch.tensor([0.5, -0.5])
    final = save(tmp_path / "ckpt", 3, [{"w": w}, {"b": b}], state_keys=["w", "b", "head.w"],
                 aliases={"head.w": "w"})
    for source in (tmp_path / "ckpt", final):  # the latest of a directory, or one step
        assert parts.export(source, tmp_path / "m.pt").step == 3
        state = torch.load(tmp_path / "m.pt", weights_only=True)
        assert list(state) == ["w", "b", "head.w"]
        assert torch.equal(state["w"], w) and torch.equal(state["b"], b) and torch.equal(state["head.w"], w)
    parts.export(final, tmp_path / "m.safetensors")
    tensors, metadata = tensorfile.read_tensors(tmp_path / "m.safetensors")
    assert list(tensors) == ["w", "b", "head.w"] and metadata == {"format": "pt"}
    assert torch.equal(tensors["head.w"], w)
    assert not list(tmp_path.glob("*.part"))


def test_export_of_a_directory_without_checkpoints_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        parts.export(tmp_path, tmp_path / "m.pt")
    assert str(info.value) == f"{tmp_path} holds no complete plait checkpoint (no step-*/ with a valid meta.json)"
    assert not (tmp_path / "m.pt").exists()


def test_read_plain_takes_either_format(tmp_path: Path) -> None:
    state = {"a": torch.arange(3.0), "b": torch.ones(2, dtype=torch.int64)}
    torch.save(state, tmp_path / "s.pt")
    with open(tmp_path / "s.safetensors", "wb") as f:
        tensorfile.write_tensors(f, state, {})
    for name in ("s.pt", "s.safetensors"):
        got = disk.read_plain(tmp_path / name)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state), name


@pytest.mark.parametrize("content, message", [
    ([1, 2], "holds a list, not a dict of name -> tensor"),
    ({"a": 1}, "holds a dict, not a dict of name -> tensor"),
    (b"not a torch file", "not a state dict torch.load(weights_only=True) can read ("),
])
def test_read_plain_refuses_what_is_not_a_state_dict(tmp_path: Path, content: object, message: str) -> None:
    path = tmp_path / "s.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(CheckpointError) as info:
        disk.read_plain(path)
    assert str(info.value).startswith(f"{path}: {message}")


def _commit_split(root: Path, split: dict) -> Path:
    """A checkpoint of one 6 x 4 tensor (a fused 3-block weight) saved in two tp parts."""
    whole = torch.arange(24.0).reshape(6, 4)
    parts = [whole[[0, 2, 4]], whole[[1, 3, 5]]]  # each rank's row of every block
    temp = disk.temp_dir(root, 1, "t0")
    described = []
    for rank, part in enumerate(parts):
        size, digest = disk.write_shard(temp, rank, {"w": part}, {"plait": "{}"})
        described.append({"file": f"rank{rank}.safetensors", "bytes": size, "sha256": digest})
    meta = {"step": 1, "state_keys": ["w"], "aliases": {}, "plan": None, "shards": described,
            "tensors": {"w": {"shard": 0, "shape": [6, 4], "dtype": "torch.float32", "split": split}}}
    return disk.commit(root, temp, 1, meta, 2)


def test_a_tensor_saved_in_tp_parts_is_read_whole(tmp_path):
    path = _commit_split(tmp_path, {"dim": 0, "blocks": 3, "shards": [0, 1]})
    ckpt = disk.open_checkpoint(path, verify=True)
    assert torch.equal(parts.read_parameters(ckpt)["w"], torch.arange(24.0).reshape(6, 4))
    assert parts.holders(ckpt.meta["tensors"]["w"]) == [0, 1]


@pytest.mark.parametrize("split", [{"dim": 2, "blocks": 1, "shards": [0, 1]},      # no such dim
                                   {"dim": 0, "blocks": 4, "shards": [0, 1]},      # 6 rows not in 4 x 2
                                   {"dim": 0, "blocks": 1, "shards": [0, 5]},      # no rank 5
                                   {"dim": 0, "blocks": 1}])
def test_a_malformed_split_is_not_a_complete_checkpoint(tmp_path, split):
    path = _commit_split(tmp_path, split)
    with pytest.raises(CheckpointError, match="tensor index is malformed"):
        disk.open_checkpoint(path)
