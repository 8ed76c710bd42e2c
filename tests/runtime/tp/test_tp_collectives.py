"""Tests for plait.runtime.tp.tp_collectives: each collective's forward and backward on 2 gloo ranks,
against the same sums and slices done on whole tensors in one process; attention split by heads
with dropout against one process's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks


def _each_kind(rank: int, world: int) -> dict[str, Any]:
    from plait.runtime.tp.tp_collectives import TpCollective
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    # every rank's input and upstream gradient, known to all: x[r], dy[r]
    x = [torch.randn(2, 4, 3, generator=g) for _ in range(world)]
    dy_whole = [torch.randn(2, 4, 3, generator=g) for _ in range(world)]
    dy_part = [torch.randn(2, 2, 3, generator=g) for _ in range(world)]
    problems = []

    def run(kind: str, dy: list[torch.Tensor], source: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        mine = source[rank].clone().requires_grad_(True)
        out = TpCollective(kind, group, rank, world, dim=1)(mine)
        out.backward(dy[rank])
        return out.detach(), mine.grad

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.allclose(got, want, atol=1e-6):
            problems.append(f"{name}: {got.flatten()[:4].tolist()} != {want.flatten()[:4].tolist()}")

    total = sum(x)
    # reduce_scatter: the sum of the parts, this rank's half of dim 1; backward: the halves' gradients gathered
    out, grad = run("reduce_scatter", dy_part, x)
    check("reduce_scatter forward", out, total[:, 2 * rank:2 * rank + 2])
    check("reduce_scatter backward", grad, torch.cat(dy_part, 1))
    # gather_partial: halves gathered whole; backward: the whole gradients summed, this rank's half kept
    halves = [t[:, :2] for t in x]
    out, grad = run("gather_partial", dy_whole, halves)
    check("gather_partial forward", out, torch.cat(halves, 1))
    check("gather_partial backward", grad, sum(dy_whole)[:, 2 * rank:2 * rank + 2])
    # scatter: this rank's half of a whole value; backward: the halves' gradients gathered
    out, grad = run("scatter", dy_part, x)
    check("scatter forward", out, x[rank][:, 2 * rank:2 * rank + 2])
    check("scatter backward", grad, torch.cat(dy_part, 1))
    # gather: halves gathered; backward: this rank's half of its own (whole, replicated) gradient
    out, grad = run("gather", dy_whole, halves)
    check("gather forward", out, torch.cat(halves, 1))
    check("gather backward", grad, dy_whole[rank][:, 2 * rank:2 * rank + 2])
    # copy: identity; backward: the gradients summed
    out, grad = run("copy", dy_whole, x)
    check("copy forward", out, x[rank])
    check("copy backward", grad, sum(dy_whole))
    dist.destroy_process_group()
    return {"problems": problems}


@pytest.mark.timeout(120)
def test_each_collective_matches_the_whole_tensor_arithmetic() -> None:
    for rank, result in enumerate(run_ranks(2, _each_kind, timeout=100)):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mask, causal, gqa", [("float", False, False), ("bool", False, False), (None, True, False),
                                               (None, False, True)], ids=["float-mask", "bool-mask", "causal", "gqa"])
def test_split_attention_keeps_its_heads_of_one_process_dropout(mask: str | None, causal: bool, gqa: bool) -> None:
    """Each tp rank's heads of attention with dropout 0.3, drawn from the same generator state,
    put side by side equal one process's F.scaled_dot_product_attention: outputs and gradients."""
    import torch.nn.functional as F

    from plait.runtime.tp.tp_collectives import SplitAttention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, requires_grad=True)  # (B, H, L, D)
    k, v = (torch.randn(2, 2 if gqa else 4, 6, 8, generator=g, requires_grad=True) for _ in range(2))  # (B, H, S, D)
    masks = {"float": torch.randn(2, 1, 5, 6, generator=g), "bool": torch.rand(2, 1, 5, 6, generator=g) > 0.3}
    attn_mask = masks.get(mask) if mask else None  # (B, 1, L, S): broadcast over the heads
    dy = torch.randn(2, 4, 5, 8, generator=g)
    torch.manual_seed(1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.3, causal, scale=0.2, enable_gqa=gqa)
    want_grads = torch.autograd.grad(want, (q, k, v), dy)
    parts, grads = [], []
    for rank in range(2):
        torch.manual_seed(1)
        kv = slice(rank, rank + 1) if gqa else slice(2 * rank, 2 * rank + 2)
        out = SplitAttention(rank, 2)(q[:, 2 * rank:2 * rank + 2], k[:, kv], v[:, kv], attn_mask, 0.3, causal,
                                      scale=0.2, enable_gqa=gqa)
        parts.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), dy[:, 2 * rank:2 * rank + 2]))
    undropped = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, causal, scale=0.2, enable_gqa=gqa)
    assert not torch.allclose(want, undropped, atol=1e-3)  # the dropout drew a mask
    torch.testing.assert_close(torch.cat(parts, 1), want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(map(sum, zip(*grads)), want_grads):  # each rank's heads' share of each gradient
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
