"""The tensor-parallel collectives a stage graph calls, as autograd functions and modules.

    kind             forward                                  backward
    copy             identity                                 all-reduce (Megatron's f)
    reduce           all-reduce                               identity (Megatron's g)
    gather           all-gather along a dim (in blocks;       this rank's part
                     uneven parts padded, then cut)
    reduce_scatter   reduce-scatter along a dim (the tokens)  all-gather
    gather_partial   all-gather along a dim                   reduce-scatter (sequence-parallel f)
    gather_partial_wide   the same, widened to fp32            reduce-scatter in fp32, rounded once
    scatter          this rank's part (no communication)      all-gather

`VocabLookup` looks up the ids in this rank's vocabulary rows; `SplitDropout` draws a split value's
mask whole (as one process draws it) and keeps this rank's part, as `SplitAttention` does for the
dropout of attention split by heads; `same_generators` makes the tp ranks' generators equal, so
that the regions every tp rank computes whole draw the same masks.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.capture.compute_dtype import LOW_DTYPES
from plait.errors import ConfigError
from plait.runtime.comm.collectives import local_device
from plait.runtime.comm.waiting import finish
from plait.runtime.eager import eager
from plait.tensor_parts import local_part, part_size, whole_of

__all__ = ["reduce_sum", "sum_both_ways", "TpCollective", "VocabLookup", "SplitDropout", "SplitAttention",
           "BroadcastSum", "Widen", "WideProduct", "Narrow", "same_generators"]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        finish(dist.all_reduce(grad, group=ctx.group, async_op=True))
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        finish(dist.all_reduce(x, group=group, async_op=True))
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBoth(torch.autograd.Function):
    """All-reduce SUM forward, and of the gradient backward (each rank holds a share of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _Reduce.forward(ctx, x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Copy.backward(ctx, grad)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, blocks: int, tp_rank: int, tp: int,
                size: int) -> torch.Tensor:
        ctx.args = (dim, blocks, tp_rank, tp)
        if size % tp:  # uneven parts (`plait.tensor_parts`): each padded to the first's rows, then cut
            return torch.cat([p.narrow(dim, 0, part_size(size, r, tp))
                              for r, p in enumerate(_padded_parts(x, group, dim, -(-size // tp), tp))], dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(tp)]
        finish(dist.all_gather(parts, x, group=group, async_op=True))
        return whole_of(parts, dim, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dim, blocks, tp_rank, tp = ctx.args
        return local_part(grad, dim, blocks, tp_rank, tp).contiguous(), None, None, None, None, None, None


def _padded_parts(x: torch.Tensor, group: Any, dim: int, rows: int, tp: int) -> list[torch.Tensor]:
    """Every rank's `x`, each padded with zeros to `rows` along `dim` (gloo gathers equal sizes)."""
    if x.shape[dim] < rows:
        pad = list(x.shape)
        pad[dim] = rows - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    finish(dist.all_gather(parts, x, group=group, async_op=True))
    return parts


def _gather_along(x: torch.Tensor, group: Any, dim: int, tp: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tp)]
    finish(dist.all_gather(parts, x.contiguous(), group=group, async_op=True))
    return torch.cat(parts, dim)


def _reduce_scatter_along(x: torch.Tensor, group: Any, dim: int, tp: int) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // tp, *front.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # its newer name, if any
    scatter(out, front, group=group)  # blocked: gloo's reduce-scatter Work never reports itself done
    return out.movedim(0, dim)


class _ReduceScatter(torch.autograd.Function):
    """Partial sums summed over the tp group, each rank keeping its part along `dim` (Megatron's
    sequence-parallel g); backward: the parts' gradients all-gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, tp: int) -> torch.Tensor:
        if x.shape[dim] % tp:
            raise ConfigError(f"sequence parallelism splits dimension {dim} of size {x.shape[dim]} over tp={tp}; "
                              "use sequences whose length divides by tp, or sequence_parallel=False")
        ctx.args = (group, dim, tp)
        return _reduce_scatter_along(x, group, dim, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, tp = ctx.args
        return _gather_along(grad, group, dim, tp), None, None, None


class _GatherPartial(torch.autograd.Function):
    """Token parts all-gathered for column-parallel linears, whose input gradients each rank holds a
    share of: backward, those summed and cut back to the parts at once (reduce-scatter; Megatron's
    sequence-parallel f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, tp: int) -> torch.Tensor:
        ctx.args = (group, dim, tp)
        return _gather_along(x, group, dim, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, tp = ctx.args
        return _reduce_scatter_along(grad, group, dim, tp), None, None, None


class _GatherPartialWide(torch.autograd.Function):
    """`_GatherPartial` for one column-parallel reader of a low-precision value, in fp32: the parts
    all-gathered and widened (exact), the reader's input-gradient shares reduce-scattered in fp32 and
    rounded once to the value's dtype (as one process rounds each reader's gradient once)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, tp: int) -> torch.Tensor:
        ctx.args = (group, dim, tp, x.dtype)
        return _gather_along(x, group, dim, tp).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, tp, dtype = ctx.args
        return _reduce_scatter_along(grad.float(), group, dim, tp).to(dtype), None, None, None


class _BroadcastSum(torch.autograd.Function):
    """A value broadcast over the tokens sequence parallelism splits (a norm's weight, a bias),
    expanded to `shape`: its gradient (each rank's tokens) summed over the broadcast dims and over
    the tp ranks in fp32, rounded once to its dtype -- as one process sums it over all tokens."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: Any, shape: torch.Size) -> torch.Tensor:
        ctx.group, ctx.shape, ctx.dtype = group, w.shape, w.dtype
        return w.expand(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = grad.float().sum_to_size(ctx.shape).contiguous()
        finish(dist.all_reduce(total, group=ctx.group, async_op=True))
        return total.to(ctx.dtype), None, None


class _Scatter(torch.autograd.Function):
    """A whole value's part along `dim` on this rank (no communication); backward: all-gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, tp_rank: int, tp: int) -> torch.Tensor:
        ctx.args = (group, dim, tp)
        return local_part(x, dim, 1, tp_rank, tp).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, tp = ctx.args
        return _gather_along(grad, group, dim, tp), None, None, None, None


def _apply(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    return cast(torch.Tensor, fn.apply(*args))  # type: ignore[no-untyped-call]


def reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x summed over the tp group; its gradient passed back as it is (Megatron's g)."""
    return _apply(_Reduce, x, group)


def sum_both_ways(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x summed over the tp group, and its gradient summed too (each rank's backward holds a share)."""
    return _apply(_SumBoth, x, group)


class TpCollective(nn.Module):
    """One collective of the tp group, as a module the stage graph calls."""

    def __init__(self, kind: str, group: Any, tp_rank: int, tp: int, dim: int = -1, blocks: int = 1, size: int = 0):
        super().__init__()
        self.kind, self.group, self.tp_rank, self.tp, self.dim, self.blocks = kind, group, tp_rank, tp, dim, blocks
        self.size = size  # a gather's whole size along `dim`, where it does not divide by tp (0: it does)

    @eager  # a compiled stage (Config.compile) runs its collectives as they are, between its graphs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "copy":
            return _apply(_Copy, x, self.group)
        if self.kind == "reduce":
            return reduce_sum(x, self.group)
        if self.kind == "reduce_scatter":
            return _apply(_ReduceScatter, x, self.group, self.dim % x.dim(), self.tp)
        if self.kind == "gather_partial":
            return _apply(_GatherPartial, x, self.group, self.dim % x.dim(), self.tp)
        if self.kind == "gather_partial_wide":
            return _apply(_GatherPartialWide, x, self.group, self.dim % x.dim(), self.tp)
        if self.kind == "scatter":
            return _apply(_Scatter, x, self.group, self.dim % x.dim(), self.tp_rank, self.tp)
        return _apply(_Gather, x, self.group, self.dim % x.dim(), self.blocks, self.tp_rank, self.tp, self.size)


class BroadcastSum(nn.Module):
    """A low-precision value broadcast over split tokens, expanded to the shape its operation's
    operands broadcast to (`_BroadcastSum`: its gradient summed in fp32, rounded once)."""

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    @eager  # a collective: run as it is between a compiled stage's graphs
    def forward(self, w: torch.Tensor, *operands: Any) -> torch.Tensor:
        shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
            w.shape, *(o.shape for o in operands if isinstance(o, torch.Tensor)))
        return _apply(_BroadcastSum, w, self.group, shape)


class Widen(nn.Module):
    """A low-precision (bf16, fp16) value in fp32, on its way into a product whose sum the tp ranks
    split: each rank's partial sum, and the sum over the ranks, stay in fp32 and are rounded to the
    low dtype once, by `Narrow` (as one process's matrix product accumulates in fp32 and rounds its
    result once). fp32 passes as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() if x.dtype in LOW_DTYPES else x


class _WideProduct(torch.autograd.Function):
    """x W^T (nn.Linear's weight) or x W (Conv1D's, mm's) of a widened x and a low-precision W, whose
    sum the tp ranks split one way: the forward's (a row-parallel product: its partial sums in fp32)
    or the input gradient's (a column-parallel one: each rank's share in fp32). The forward runs in
    fp32 (rounded once after the sum, or after the bias); the directions no rank splits -- W's
    gradient, and a row-parallel product's input gradient -- run in the low dtype as one process's
    backward runs them. What backward needs is kept in the low dtype (x's values came from it: exact)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, transposed: bool, split_input_grad: bool) -> torch.Tensor:
        ctx.save_for_backward(x.to(w.dtype), w)
        ctx.transposed, ctx.split_input_grad = transposed, split_input_grad
        w32 = w.float()
        return x.float() @ (w32.t() if transposed else w32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        low = rows.to(w.dtype)  # the gradient of a rounded value: exact in the low dtype
        # x's gradient: each rank's share of a split sum in fp32, else as one process computes it
        rows_x, w_x = (rows.float(), w.float()) if ctx.split_input_grad else (low, w)
        gx = torch.mm(rows_x, w_x if ctx.transposed else w_x.t())
        xs = x.reshape(-1, x.shape[-1])
        gw = torch.mm(low.t(), xs) if ctx.transposed else torch.mm(xs.t(), low)
        return gx.float().reshape(*grad.shape[:-1], gx.shape[-1]), gw, None, None


class WideProduct(nn.Module):
    """A product the tp ranks split a sum of (`_WideProduct`): `split_input_grad`, a column-parallel
    product's input gradient; else a row-parallel product's output."""

    def __init__(self, transposed: bool, split_input_grad: bool):
        super().__init__()
        self.transposed, self.split_input_grad = transposed, split_input_grad

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _apply(_WideProduct, x, w, self.transposed, self.split_input_grad)


class Narrow(nn.Module):
    """A product computed wide (`Widen`), rounded back to the dtype of the value it came from."""

    def forward(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return y.to(like.dtype) if y.dtype != like.dtype else y


class VocabLookup(nn.Module):
    """An embedding whose rows are split over the tp ranks: each looks up the ids in its rows, which
    begin at row `start` (its part's, even or not: `plait.tensor_parts.part_rows`)."""

    def __init__(self, group: Any, start: int, padding_idx: int):
        super().__init__()
        self.group, self.start, self.padding_idx = group, start, padding_idx

    @eager  # a collective: run as it is between a compiled stage's graphs
    def forward(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows, start = weight.shape[0], self.start
        outside = (ids < start) | (ids >= start + rows)
        local = (ids - start).masked_fill(outside, 0)
        pad = self.padding_idx - start if start <= self.padding_idx < start + rows else None
        out = F.embedding(local, weight, padding_idx=pad)
        return reduce_sum(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class SplitDropout(nn.Module):
    """Dropout of a split value: the whole mask drawn (as one process draws it), this rank's part kept."""

    def __init__(self, dim: int, blocks: int, tp_rank: int, tp: int, size: int = 0):
        super().__init__()
        self.dim, self.blocks, self.tp_rank, self.tp, self.size = dim, blocks, tp_rank, tp, size

    def forward(self, x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        if not train or p == 0.0:
            return x
        return _dropped(x, p, self.dim, self.blocks, self.tp_rank, self.tp, self.size)


def _dropped(x: torch.Tensor, p: float, dim: int, blocks: int, tp_rank: int, tp: int, size: int = 0) -> torch.Tensor:
    """x times this rank's part of the whole mask (`size` along `dim`; 0: tp parts of x's),
    drawn as torch's CPU dropout draws it."""
    shape = list(x.shape)
    shape[dim] = size or shape[dim] * tp
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    if p < 1.0:
        keep.div_(1 - p)
    return x * local_part(keep, dim, blocks, tp_rank, tp)


class SplitAttention(nn.Module):
    """scaled_dot_product_attention with dropout on this rank's heads, unfused as torch's math path
    (`_scaled_dot_product_attention_math`, what one process runs on CPU) computes it; its dropout
    draws the whole (B, H, L, S) mask and keeps this rank's heads. A fused kernel draws its mask
    inside, where no rank could take its part of one process's."""

    def __init__(self, tp_rank: int, tp: int):
        super().__init__()
        self.tp_rank, self.tp = tp_rank, tp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
        size = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        factor = math.sqrt(abs(size))  # q and k each scaled by sqrt(scale), as torch does
        q = q * (-factor if size < 0 else factor)
        if is_causal:
            attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # True: attend
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        if enable_gqa:  # each rank holds its share of the key/value heads: the same ratio
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        attn = q @ (k.transpose(-2, -1) * factor)  # (B, H/tp, L, S)
        if attn_mask is not None:
            attn = attn + attn_mask
        attn = torch.ops.aten._safe_softmax(attn, -1)  # (a row masked whole: zeros, as torch's)
        if dropout_p > 0.0:
            attn = _dropped(attn, dropout_p, attn.dim() - 3, 1, self.tp_rank, self.tp)
        return attn @ v  # (B, H/tp, L, D)


def same_generators(src: int, group: Any) -> None:
    """This rank's torch generators (CPU, and its CUDA device's) set to rank `src`'s, over `group`:
    the tp ranks then draw the same dropout masks where each computes the whole value."""
    device = local_device()
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    moved = [state.to(device) for state in states]
    for state in moved:
        dist.broadcast(state, src, group=group)
    torch.set_rng_state(moved[0].cpu())
    if device.type == "cuda":
        torch.cuda.set_rng_state(moved[1].cpu(), device)
