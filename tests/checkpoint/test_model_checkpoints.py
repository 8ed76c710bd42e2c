"""Tests for plait.checkpoint.model_checkpoints: a model's checkpoint whose meta.json lost a tensor's
shape is refused by name, not with a KeyError (found by tests/test_fuzz.py). One process."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import plait
from tests.models import mlp


@pytest.mark.parametrize("shape", [None, [16, -1], "16"])
def test_a_tensor_entry_without_a_valid_shape_is_named(tmp_path, shape) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
    model = plait.Model(mlp(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    model.train_on_batch(x, y)
    model.save(tmp_path)
    meta_path = next(tmp_path.glob("step-*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    name = sorted(meta["tensors"])[0]
    if shape is None:
        del meta["tensors"][name]["shape"]
    else:
        meta["tensors"][name]["shape"] = shape
    meta_path.write_text(json.dumps(meta))
    other = plait.Model(mlp(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    with pytest.raises(plait.CheckpointError, match=f"tensor '{name}' has no valid shape"):
        other.load(tmp_path)
