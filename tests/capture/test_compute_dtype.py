"""Tests for plait.capture.compute_dtype: a model held in bf16 while it is captured, its fp32 values back exactly after."""

from __future__ import annotations

import torch
from torch import nn

from plait.capture.compute_dtype import cast_floating, dtype_of, held_in
from plait.capture.trace import capture_batch


def net() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model.register_buffer("scale", torch.full((2,), 0.5))  # a buffer keeps its dtype (FSDP2's policy)
    return model


def test_parameters_hold_the_dtype_inside_and_their_exact_values_after():
    model = net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    objects = [id(p) for p in model.parameters()]
    with held_in(model, torch.bfloat16):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.scale.dtype == torch.float32
    assert [id(p) for p in model.parameters()] == objects  # the same parameters: graphs read them by name
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())
    with held_in(model, torch.float32):  # fp32: nothing changes
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_graph_captured_held_in_bf16_computes_in_bf16():
    model = net()
    with held_in(model, torch.bfloat16):
        graph = capture_batch(model, cast_floating(torch.randn(6, 4), torch.bfloat16))
        out = graph.root(*graph.bind((torch.randn(3, 4, dtype=torch.bfloat16),), {}))
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert out.dtype == torch.bfloat16


def test_only_floating_tensors_are_cast():
    batch = {"ids": torch.tensor([1, 2]), "mask": torch.tensor([True, False]), "x": torch.randn(2, 3),
             "rest": [torch.randn(2, dtype=torch.float64), 3.0]}
    cast = cast_floating(batch, torch.bfloat16)
    assert cast["ids"].dtype == torch.int64 and cast["mask"].dtype == torch.bool
    assert cast["x"].dtype == torch.bfloat16 and cast["rest"][0].dtype == torch.bfloat16 and cast["rest"][1] == 3.0
    assert dtype_of("bf16") == torch.bfloat16 and dtype_of("fp16") == torch.float16 and dtype_of("fp32") == torch.float32
