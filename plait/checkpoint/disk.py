"""Checkpoints on disk: a directory per step, a tensor file per rank, visible only once complete.

    checkpoint_dir/
      latest                      "step-000120\\n", replaced (temp file, fsync, rename) last of all
      step-000100/                the previous complete checkpoint: the fallback
      step-000120/
        rank0.safetensors ...     one shard per rank: the tensors it owns, its optimizer state and
                                  its RNG states (tensorfile.py: safetensors bytes, no pickle)
        meta.json                 step, plan, config, data position, every shard's size and sha256
      step-000140.tmp-<token>/    being written, or left by a crash: never read, pruned later

Saving, on every rank:  write rank{r}.safetensors.part, fsync, rename, fsync the directory
                        -> everyone reports (size, sha256) to rank 0 (a collective, in model.py)
then on rank 0 only:    meta.json (temp, fsync, rename) -> rename step-K.tmp-<token> to step-K
                        -> `latest` (temp, fsync, rename) -> prune all but the newest `keep`.
A crash anywhere before `latest` moves leaves the previous checkpoint in charge; a checkpoint
is read only after its meta.json parses and every shard has the recorded size and sha256.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from plait.checkpoint import tensorfile
from plait.errors import CheckpointError, first_line

__all__ = ["Checkpoint", "FORMAT", "step_name", "temp_dir", "write_shard", "write_tensor_file", "write_atomic", "commit", "open_checkpoint",
           "find_resumable", "is_checkpoint_dir", "read_plain"]

log = logging.getLogger("plait")

FORMAT = "plait-checkpoint-1"
_STEP = re.compile(r"step-(\d{6,})")
_MAX_META = 64 * 2**20


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def temp_dir(root: str | os.PathLike[str], step: int, token: str) -> Path:
    """Where the ranks write step `step` before rank 0 commits it (one name per job incarnation)."""
    return Path(root) / f"{step_name(step)}.tmp-{token}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data`: readers see the old bytes or the new ones, never a part."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    _fsync_dir(path.parent)


def write_shard(directory: Path, rank: int, tensors: Mapping[str, torch.Tensor],
                metadata: Mapping[str, str]) -> tuple[int, str]:
    """Write this rank's shard durably; return its (size in bytes, sha256)."""
    return write_tensor_file(directory / f"rank{rank}.safetensors", tensors, metadata)


def write_tensor_file(final: Path, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str]) -> tuple[int, str]:
    """Write a safetensors file durably (a part file, fsynced, renamed); return its (size, sha256)."""
    directory = final.parent
    directory.mkdir(parents=True, exist_ok=True)
    part = final.with_name(final.name + ".part")
    with open(part, "wb") as f:
        digest = tensorfile.write_tensors(f, tensors, metadata)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, final)
    _fsync_dir(directory)
    return final.stat().st_size, digest


def commit(root: str | os.PathLike[str], temp: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Rank 0, once every shard is durable: write meta.json, publish the step, move `latest`, prune."""
    root = Path(root)
    write_atomic(temp / "meta.json", json.dumps({"format": FORMAT, **meta}, indent=1).encode())
    final = root / step_name(step)
    if final.exists():  # left by an attempt whose `latest` never moved: superseded by this one
        aside = root / f"{final.name}.old-{temp.name.rsplit('-', 1)[-1]}"
        os.replace(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(temp, final)
    _fsync_dir(root)
    write_atomic(root / "latest", f"{final.name}\n".encode())
    _prune(root, step, keep)
    return final


def _steps(root: Path) -> list[int]:
    out = []
    for entry in root.iterdir() if root.is_dir() else []:
        m = _STEP.fullmatch(entry.name)
        if m and entry.is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` has plait's layout: a step directory (meta.json), or a checkpoint directory
    (`latest`, or step-* directories), complete or not."""
    path = Path(path)
    return path.is_dir() and ((path / "meta.json").exists() or (path / "latest").exists() or bool(_steps(path)))


def _prune(root: Path, latest: int, keep: int) -> None:
    """Keep `latest` and the keep-1 newest before it; drop the rest, newer orphans and temp dirs."""
    older = [s for s in _steps(root) if s < latest]
    doomed = [s for s in _steps(root) if s > latest] + older[: max(0, len(older) - (keep - 1))]
    for s in doomed:
        shutil.rmtree(root / step_name(s), ignore_errors=True)
    for entry in root.iterdir():
        m = re.fullmatch(r"step-(\d{6,})\.(tmp|old)-.*", entry.name)
        if m and int(m.group(1)) <= latest and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk: its directory and its checked meta.json."""

    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def world_size(self) -> int:
        return len(self.meta["shards"])

    def same_layout(self, plan: dict[str, Any]) -> bool:
        """Whether `plan` (Plan.to_json() as a dict) puts every stage on the ranks this one did."""
        saved = self.meta.get("plan")
        keys = ("layers_per_stage", "dp", "num_virtual_stages", "world_size")
        return (isinstance(saved, dict) and all(saved.get(k) == plan.get(k) for k in keys)
                and saved.get("tp", 1) == plan.get("tp", 1)
                and all((saved.get(k) or []) == (plan.get(k) or []) for k in ("stage_tp", "stage_dp")))

    def shard_path(self, rank: int) -> Path:
        return self.path / str(self.meta["shards"][rank]["file"])

    def read_shard(self, rank: int, select: tensorfile.Select | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, the JSON under __metadata__["plait"]) of one rank's shard, its sha256 checked;
        `select`: which tensors, whole or which rows (`tensorfile.read_tensors`)."""
        tensors, metadata = tensorfile.read_tensors(self.shard_path(rank), self.meta["shards"][rank]["sha256"], select)
        try:
            part = json.loads(metadata.get("plait", "{}"))
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{self.shard_path(rank)}: its metadata is not JSON ({e})") from None
        if not isinstance(part, dict):
            raise CheckpointError(f"{self.shard_path(rank)}: its metadata is not a JSON object")
        return tensors, part

    def verify(self) -> None:
        """Read every shard and check its size, sha256 and header: CheckpointError if any is off
        (each read in blocks: memory holds none of its tensors)."""
        for rank, shard in enumerate(self.meta["shards"]):
            path = self.shard_path(rank)
            try:
                size = path.stat().st_size
            except OSError:
                raise CheckpointError(f"{self.path}: shard {shard['file']} is missing") from None
            if size != shard["bytes"]:
                raise CheckpointError(
                    f"{path}: {size} bytes, meta.json recorded {shard['bytes']} (truncated or replaced)"
                )
            self.read_shard(rank, lambda name: False)  # its bytes hashed and its header checked, nothing kept


def _check_meta(meta: Any, where: Path) -> dict[str, Any]:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}/meta.json: {what}; it is not a complete plait checkpoint")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f"format is not {FORMAT!r}")
    if type(meta.get("step")) is not int or meta["step"] < 0:
        raise bad("no step number")
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        raise bad("no shards listed")
    for rank, s in enumerate(shards):
        if not (isinstance(s, dict) and s.get("file") == f"rank{rank}.safetensors"
                and type(s.get("bytes")) is int and isinstance(s.get("sha256"), str)):
            raise bad(f"shard {rank} is described as {s!r}"[:200])
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict) or not all(
            isinstance(v, dict) and type(v.get("shard")) is int and 0 <= v["shard"] < len(shards)
            and _split_ok(v.get("split"), v.get("shape"), len(shards))
            for v in tensors.values()):
        raise bad("the tensor index is malformed")
    if not (isinstance(meta.get("state_keys"), list) and all(isinstance(k, str) for k in meta["state_keys"])):
        raise bad("state_keys must list the state dict's names")
    if not isinstance(meta.get("aliases"), dict):
        raise bad("aliases are missing")
    if meta.get("plan") is not None and not isinstance(meta["plan"], dict):
        raise bad("the plan is not a JSON object")
    unresolved = [k for k in meta["state_keys"] if meta["aliases"].get(k, k) not in tensors]
    if unresolved or set(tensors) - set(meta["state_keys"]):
        raise bad(f"state_keys, aliases and the tensor index disagree (e.g. {(unresolved or sorted(tensors))[:3]})")
    if not all(isinstance(a, str) and isinstance(b, str) for a, b in meta["aliases"].items()):
        raise bad("aliases must map names to names")
    return meta


def _split_ok(split: Any, shape: Any, world: int) -> bool:
    """A tensor's "split" in meta.json: none, or {"dim", "blocks", "shards"} that cut its shape."""
    if split is None:
        return True
    if not isinstance(split, dict) or not isinstance(shape, list):
        return False
    dim, blocks, ranks = split.get("dim"), split.get("blocks"), split.get("shards")
    return (type(dim) is int and type(blocks) is int and isinstance(ranks, list) and len(ranks) > 0
            and all(type(r) is int and 0 <= r < world for r in ranks) and 0 <= dim < len(shape) and blocks > 0
            and type(shape[dim]) is int and (shape[dim] % (blocks * len(ranks)) == 0 or blocks == 1))  # (1: uneven parts)


def open_checkpoint(path: str | os.PathLike[str], verify: bool = False) -> Checkpoint:
    """The checkpoint in step directory `path` (meta.json checked; with `verify`, every shard too)."""
    path = Path(path)
    try:
        with open(path / "meta.json", "rb") as f:
            raw = f.read(_MAX_META + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: no readable meta.json ({e.strerror or e}); not a complete checkpoint") from None
    if len(raw) > _MAX_META:
        raise CheckpointError(f"{path}/meta.json is larger than {_MAX_META} bytes; not a plait checkpoint")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}/meta.json is not JSON ({type(e).__name__}: {e}); the file is damaged") from None
    ckpt = Checkpoint(path, _check_meta(meta, path))
    if verify:
        ckpt.verify()
    return ckpt


def find_resumable(root: str | os.PathLike[str]) -> Checkpoint | None:
    """The checkpoint `latest` names, else (damaged or missing) the newest older complete one.

    Every candidate is verified in full; each one passed over is logged with the reason.
    None when `root` holds no complete checkpoint.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = _steps(root)[::-1]
    pointer = root / "latest"
    if pointer.exists():
        try:
            text = pointer.read_bytes()[:64].decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            text = ""
        m = _STEP.fullmatch(text)
        if m:
            named = int(m.group(1))  # newer directories are orphans of an abandoned attempt
            candidates = [named] + [s for s in candidates if s < named]
        else:
            log.warning("plait: %s does not name a checkpoint (%r); looking for the newest complete one",
                        pointer, text[:40])
    for step in candidates:
        try:
            return open_checkpoint(root / step_name(step), verify=True)
        except CheckpointError as e:
            log.warning("plait: skipping checkpoint %s: %s", step_name(step), e)
    return None


def read_plain(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A plain state dict from a .safetensors file or torch.save output (weights_only: no code runs)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return tensorfile.read_tensors(path)[0]
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any damage or refusal becomes one clear error
        raise CheckpointError(f"{path}: not a state dict torch.load(weights_only=True) can read "
                              f"({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a dict of name -> tensor")
    return state
