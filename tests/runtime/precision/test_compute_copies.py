"""Tests for plait.runtime.precision.compute_copies: stages compute with bf16 copies, gradients land in the fp32 masters."""

from __future__ import annotations

import torch
from torch import nn

from plait.capture.compute_dtype import cast_floating, held_in
from plait.capture.split import split
from plait.capture.trace import capture_batch
from plait.runtime.precision.compute_copies import ComputeCopies


def stage_of(model: nn.Module):
    with held_in(model, torch.bfloat16):
        graph = capture_batch(model, cast_floating(torch.randn(6, 4), torch.bfloat16))
    return split(graph, [0] * len(graph.layers.layer_names))[0]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_the_copy_computes_in_bf16_and_leaves_the_model_untouched():
    net = model()
    stage = stage_of(net)
    copies = ComputeCopies(torch.bfloat16)
    low = copies.stage(stage)
    assert {p.dtype for p in low.module.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in stage.module.parameters()} == {torch.float32}  # the stage as split: masters
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    assert {id(p) for p in stage.module.parameters()} <= {id(p) for p in net.parameters()}
    assert copies.copy_bytes == sum(p.numel() * 2 for p in net.parameters())
    out = low.module(torch.randn(3, 4, dtype=torch.bfloat16))
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert out.dtype == torch.bfloat16


def test_each_backward_adds_its_gradient_into_the_fp32_master_and_listeners_hear_it():
    net = model()
    stage = stage_of(net)
    copies = ComputeCopies(torch.bfloat16)
    low = copies.stage(stage)
    heard: list[int] = []
    first = net[0].weight
    copies.after_grad(first, lambda p: heard.append(id(p)))
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):  # two micro-batches
        out = low.module(x)
        (out[0] if isinstance(out, (list, tuple)) else out).float().sum().backward()
        grads.append([p.grad for p in low.module.parameters()])
    assert all(g is None for gs in grads for g in gs)  # the copies' gradients moved out each time
    assert first.grad is not None and first.grad.dtype == torch.float32
    assert heard == [id(first), id(first)]  # once per micro-batch, as a post-accumulate hook
    by_hand = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.bfloat16)
    by_hand.load_state_dict(net.state_dict())
    expected = None
    for _ in range(2):
        by_hand.zero_grad()
        by_hand(x).float().sum().backward()
        g = by_hand[0].weight.grad.float()
        expected = g if expected is None else expected + g
    assert torch.equal(first.grad, expected)  # each bf16 gradient added in fp32


def test_refresh_takes_the_masters_values():
    net = model()
    copies = ComputeCopies(torch.bfloat16)
    low = copies.stage(stage_of(net))
    copy_weight = [p for p in low.module.parameters() if p.shape == net[0].weight.shape][0]
    with torch.no_grad():
        net[0].weight.add_(1.0)  # an optimizer step on the master
    assert not torch.equal(copy_weight, net[0].weight.to(torch.bfloat16))  # stale until refreshed
    copies.refresh()
    assert torch.equal(copy_weight, net[0].weight.to(torch.bfloat16))


def test_batched_weight_gradients_of_a_copy_land_in_fp32_in_the_master_and_leave_the_stage_as_split():
    """Batched (plait.runtime.batched_wgrad), a copy's linears keep their bf16 inputs and output gradients and the
    step's dW is one fp32 GEMM added into the master; the rewrite is the copy's own graph's, not the split stage's."""
    from plait.runtime.batched_wgrad import defer_linear_weight_grads

    net = model()
    stage = stage_of(net)
    copies = ComputeCopies(torch.bfloat16)
    low = copies.stage(stage)
    batch = defer_linear_weight_grads(low.module)
    assert batch is not None and len(batch.anchors) == 2
    batch.add_wide = copies.add_wide  # (as the stage's executor sets it below fp32)
    assert "deferred" not in stage.module.code and "deferred" in low.module.code
    heard = []
    for p in net.parameters():
        copies.after_grad(p, lambda q: heard.append(id(q)))
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    for rows in (slice(0, 2), slice(2, 6)):  # two micro-batches
        out = low.module(x[rows])
        out = out[0] if isinstance(out, (list, tuple)) else out
        out.float().pow(2).sum().backward()
    assert all(p.grad is None for p in low.module.parameters()) and heard == []
    first = next(p for p in low.module.parameters() if p.shape == net[0].weight.shape)  # the first linear's copy
    _, _, xs, gys = batch._pending[id(first)]  # its bf16 inputs and output gradients, as kept
    assert len(xs) == 2 and xs[0].dtype == gys[0].dtype == torch.bfloat16
    gy = torch.cat(gys).float()
    batch.flush()
    master = net[0]
    assert master.weight.grad.dtype == torch.float32
    torch.testing.assert_close(master.weight.grad, gy.t().mm(torch.cat(xs).float()), rtol=0, atol=0)
    torch.testing.assert_close(master.bias.grad, gy.sum(0), rtol=0, atol=0)
    assert sorted(heard) == sorted(id(p) for p in net.parameters())  # once each
    assert all(p.grad is None for p in low.module.parameters())


def test_an_fp16_wide_gradient_past_fp16s_range_reaches_the_master_as_inf():
    net = model()
    copies = ComputeCopies(torch.float16)
    low = copies.stage(stage_of_fp16(net))
    weight = next(p for p in low.module.parameters() if p.dim() == 2)
    grad = torch.full(weight.shape, 1.0)
    grad[0, 0] = 70000.0  # finite in fp32, past fp16's 65504
    copies.add_wide(weight, grad)
    master = next(p for p in net.parameters() if p.shape == weight.shape and p.grad is not None)
    assert torch.isinf(master.grad[0, 0]) and bool(torch.isfinite(master.grad.flatten()[1:]).all())


def stage_of_fp16(model: nn.Module):
    with held_in(model, torch.float16):
        graph = capture_batch(model, cast_floating(torch.randn(6, 4), torch.float16))
    return split(graph, [0] * len(graph.layers.layer_names))[0]
