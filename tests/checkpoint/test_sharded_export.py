"""model.export: Hugging Face sharded safetensors written rank by rank, read back by from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait.checkpoint.sharded_export import model_bytes, shard_files
from tests.harness import run_ranks

transformers = pytest.importorskip("transformers")


def test_shard_files_follow_the_owning_ranks() -> None:
    entries = {"a": {"shard": 0}, "b": {"shard": 2}, "c": {"shard": 0}}
    assert shard_files(entries) == {0: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}
    assert shard_files({"a": {"shard": 0}}) == {0: "model.safetensors"}


def test_model_bytes_counts_a_tied_tensor_once_and_meta_tensors_by_shape() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    net[1].weight = net[0].weight
    assert model_bytes(net) == 10 * 4 * 4


def _llama() -> nn.Module:
    from tests.architectures import _configs

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_configs(transformers)["llama"]())


def export_on_two_stages(rank: int, world: int, out: str) -> dict[str, Any]:
    from tests.architecture_runs import valid_cut
    from plait.capture.trace import capture_batch

    net = _llama()
    tokens = torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    loss = lambda o, y: nn.functional.cross_entropy(o.logits.flatten(0, 1), y.flatten())  # noqa: E731
    cut = valid_cut(capture_batch(net, {"input_ids": tokens}).layers, 2)
    model = plait.Model(net, plait.Config(layers_per_stage=cut, num_microbatches=2, timeout_s=30.0),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=loss)
    model.train_on_batch({"input_ids": tokens}, torch.roll(tokens, -1, 1))
    model.export(out)
    small = plait.Model(_llama(), plait.Config(layers_per_stage=cut, memory_limit_bytes=1000.0, timeout_s=30.0),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=loss)
    try:
        small.state_dict()
        refused = ""
    except plait.CheckpointError as e:
        refused = str(e)
    return {"state": model.state_dict(), "refused": refused}


@pytest.mark.timeout(200)
def test_each_rank_writes_its_stage_and_from_pretrained_reads_the_model(tmp_path: Path) -> None:
    out = tmp_path / "exported"
    report = run_ranks(2, export_on_two_stages, str(out), timeout=180)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files + ["config.json", "model.safetensors.index.json"])
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32  # the model's own, not a default
    from safetensors import safe_open

    with safe_open(str(out / files[0]), framework="pt") as f:
        first = set(f.keys())
    assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first  # stage 0's tensors only
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    want = report[0]["state"]
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    message = report[0]["refused"]
    assert "state_dict() would hold the whole model" in message and "model.export(directory)" in message
