"""Fuzzing the readers of untrusted bytes: tensor files, checkpoints, plans and configs.

Random bytes, truncations, flipped bits and JSON-aware edits (a field replaced by a random
value) go into each reader; it must succeed or raise plait's error, nothing else. Each fuzz
loop runs in a child interpreter with a timeout, so a crash or a hang fails the test instead
of taking pytest down; a failing input is saved and its path printed, to reproduce it.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _in_child(name: str, seed: int, rounds: int) -> None:
    code = f"from tests.test_fuzz import {name}; {name}({seed}, {rounds})"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, f"{name} exited with {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    assert f"fuzzed {rounds}" in result.stdout, result.stdout[-2000:]


# -- mutations -------------------------------------------------------------------------------------


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "big", "neg", "float", "str", "null", "bool"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(0, 40)
    if kind == "big":
        return rng.choice([2**31, 2**63, 2**64 + 1, 10**30])
    if kind == "neg":
        return -rng.randint(1, 2**40)
    if kind == "float":
        return rng.choice([0.5, -1.0, 1e308, float("nan"), float("inf")])
    if kind == "str":
        return rng.choice(["", "F32", "BOOL", "x" * rng.randint(1, 50), "step-000001", "../..", "\u00e9"])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "shape", "dtype", "data_offsets", "shard", "file"]): random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def mutate_json(value: Any, rng: random.Random) -> Any:
    """A copy of `value` with one random node replaced, deleted or added."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        out = dict(value)
        action = rng.random()
        if action < 0.15:
            del out[key]
        elif action < 0.25:
            out[f"k{rng.randint(0, 9)}"] = random_json(rng)
        elif action < 0.5:
            out[key] = random_json(rng)
        else:
            out[key] = mutate_json(value[key], rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.8:
        out = list(value)
        i = rng.randrange(len(out))
        action = rng.random()
        if action < 0.15:
            del out[i]
        elif action < 0.3:
            out.insert(i, random_json(rng))
        else:
            out[i] = mutate_json(value[i], rng) if rng.random() < 0.6 else random_json(rng)
        return out
    return random_json(rng)


def mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    action = rng.random()
    if action < 0.2:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
    if action < 0.5:
        return raw[: rng.randint(0, len(raw))]
    out = bytearray(raw)
    for _ in range(rng.randint(1, 8)):
        if out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _fuzz(rounds: int, rng: random.Random, make: Callable[[random.Random], bytes], read: Callable[[bytes], Any],
          allowed: tuple[type[BaseException], ...]) -> None:
    outcomes = {"ok": 0, "refused": 0}
    for i in range(rounds):
        raw = make(rng)
        try:
            read(raw)
            outcomes["ok"] += 1
        except allowed:
            outcomes["refused"] += 1
        except BaseException:
            keep = Path(tempfile.mkdtemp(prefix="plait-fuzz-")) / "input.bin"
            keep.write_bytes(raw)
            print(f"round {i}: input saved in {keep}")
            raise
    print(f"fuzzed {rounds}: {outcomes}")


# -- tensor files ------------------------------------------------------------------------------------


def _tensor_file() -> bytes:
    import io

    import torch

    from plait.checkpoint import tensorfile

    buf = io.BytesIO()
    tensorfile.write_tensors(buf, {"w": torch.randn(3, 4), "b": torch.arange(3), "m": torch.tensor([True]),
                                   "s": torch.tensor(1.5, dtype=torch.bfloat16)}, {"plait": '{"rank": 0}'})
    return buf.getvalue()


def _edit_header(raw: bytes, rng: random.Random) -> bytes:
    (size,) = struct.unpack("<Q", raw[:8])
    header = mutate_json(json.loads(raw[8:8 + size]), rng)
    text = json.dumps(header).encode()
    if rng.random() < 0.1:  # a lying length field
        return struct.pack("<Q", rng.choice([0, len(text) - 1, len(text) + 7, 2**63])) + text + raw[8 + size:]
    return struct.pack("<Q", len(text)) + text + raw[8 + size:]


def fuzz_tensor_files(seed: int, rounds: int) -> None:
    from plait.checkpoint import tensorfile
    from plait.errors import CheckpointError

    valid = _tensor_file()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"

        def read(raw: bytes) -> None:
            path.write_bytes(raw)
            tensorfile.read_tensors(path)

        _fuzz(rounds, random.Random(seed),
              lambda rng: _edit_header(valid, rng) if rng.random() < 0.5 else mutate_bytes(valid, rng),
              read, (CheckpointError,))


@pytest.mark.timeout(300)
def test_fuzz_the_tensor_file_reader():
    _in_child("fuzz_tensor_files", 1, 4000)


# -- checkpoints ------------------------------------------------------------------------------------


def fuzz_checkpoints(seed: int, rounds: int) -> None:
    """Damage a real 1-process checkpoint (meta.json, the shard -- also re-signed, so the JSON
    inside it is read -- or `latest`); find it, open it, load it into a model and train a step."""
    import hashlib
    import shutil

    import torch
    from torch import nn

    import plait
    from plait.checkpoint import disk as checkpoint
    from plait.checkpoint.parts import export
    from tests.models import mlp

    torch.manual_seed(0)
    x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
    model = plait.Model(mlp(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss=nn.CrossEntropyLoss())
    with tempfile.TemporaryDirectory() as tmp:
        good = Path(tmp) / "good"
        model.train_on_batch(x, y)
        model.save(good)
        step = next(good.glob("step-*"))
        meta, shard = (step / "meta.json").read_bytes(), (step / "rank0.safetensors").read_bytes()
        work = Path(tmp) / "work"

        def make(rng: random.Random) -> bytes:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(good, work)
            target = rng.choice(["meta", "meta-json", "shard", "shard-resigned", "latest"])
            if target == "meta":
                (work / step.name / "meta.json").write_bytes(mutate_bytes(meta, rng))
            elif target == "meta-json":
                (work / step.name / "meta.json").write_text(json.dumps(mutate_json(json.loads(meta), rng)))
            elif target == "latest":
                (work / "latest").write_bytes(mutate_bytes(b"step-000001\n", rng))
            else:
                raw = _edit_header(shard, rng) if rng.random() < 0.7 else mutate_bytes(shard, rng)
                (work / step.name / "rank0.safetensors").write_bytes(raw)
                if target == "shard-resigned":  # a consistent, hostile checkpoint: the hash matches
                    data = json.loads(meta)
                    data["shards"][0].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
                    (work / step.name / "meta.json").write_text(json.dumps(data))
            return target.encode()

        def read(_: bytes) -> None:
            checkpoint.find_resumable(work)
            if (work / step.name / "meta.json").exists():
                try:
                    export(work / step.name, work / "plain.pt")
                finally:
                    model.load(work / step.name)
                    model.train_on_batch(x, y)

        _fuzz(rounds, random.Random(seed), make, read, (plait.CheckpointError,))


@pytest.mark.timeout(300)
def test_fuzz_the_checkpoint_reader_and_loader():
    _in_child("fuzz_checkpoints", 2, 600)


# -- plans and configs ---------------------------------------------------------------------------------


def fuzz_configs(seed: int, rounds: int) -> None:
    import plait

    valid = plait.Config(layers_per_stage=(2, 3), schedule="interleaved", num_virtual_stages=2, dp=2,
                         checkpoint_dir="ckpt", checkpoint_every=5, recompute=(0, 1)).to_json()

    def make(rng: random.Random) -> bytes:
        if rng.random() < 0.6:
            return json.dumps(mutate_json(json.loads(valid), rng)).encode()
        return mutate_bytes(valid.encode(), rng)

    _fuzz(rounds, random.Random(seed), make, plait.Config.from_json, (plait.ConfigError,))


def fuzz_plans(seed: int, rounds: int) -> None:
    import plait

    valid = plait.Plan(layer_names=("a", "b", "c", "d"), layers_per_stage=(1, 1, 2), num_microbatches=4,
                       schedule="1f1b", world_size=3, capture_method="torch.export", uncuttable=((1, 2),),
                       tied_parameters=(("w", (0, 2)),), recompute=(1,)).to_json()

    def make(rng: random.Random) -> bytes:
        if rng.random() < 0.6:
            return json.dumps(mutate_json(json.loads(valid), rng)).encode()
        return mutate_bytes(valid.encode(), rng)

    def read(raw: bytes) -> None:
        plait.Plan.from_json(raw.decode("utf-8", errors="replace"))

    _fuzz(rounds, random.Random(seed), make, read, (plait.ConfigError,))


@pytest.mark.timeout(300)
def test_fuzz_the_config_loader():
    _in_child("fuzz_configs", 3, 3000)


@pytest.mark.timeout(300)
def test_fuzz_the_plan_loader():
    _in_child("fuzz_plans", 4, 3000)
