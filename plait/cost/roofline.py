"""Roofline times of a GPT's operators on a GPU: GEMMs by their shape, the rest by the bytes they move.

A GEMM of M x K by K x N (`batch` of them) takes (Williams et al. 2009; NVIDIA, "Matrix
Multiplication Background User's Guide", 2023, chapters 2-3):

    max(2 M N K batch / (rate x quantization x k_fill), (M K + K N) batch x dtype / bandwidth)
      + M N batch x dtype / bandwidth

    quantization  cuBLAS cuts the output into tiles (256x128, 128x256, 128x128, 128x64, 64x128,
                  64x64) that run in waves of one tile per SM: the useful M N batch over
                  waves x SMs x tile area (tile and wave quantization), for the best tile
    k_fill        K / (K + pipeline): the main loop over K fills a software pipeline of
                  `PIPELINE_K` elements of K before the tensor cores run at rate (CUTLASS's
                  multistage kernels: 3 stages of 32)

    rate          the tensor cores' sustained rate: the data sheet's peak, or, where a GEMM
                  benchmark measured the device's best (`measured_flops` at `measured_shape`,
                  the Maximum Achievable Matmul FLOPS of Bekman's ML Engineering book), that
                  figure over this model's own quantization x k_fill at that shape -- so the
                  roofline gives the measured figure back at the measured shape
    ceiling       such a benchmark reports the best rate over the shapes it scanned, so no GEMM
                  is timed faster than `measured_flops` (the shape terms alone would put a
                  large GEMM that quantizes better than the measured shape above it)
    epilogue      the output tile is stored after the main loop over K, not beside it (CUTLASS's
                  multistage kernels run their epilogue once the K loop ends), so writing C adds
                  to the time where reading A and B overlaps the FLOPs; it shows where C is large
                  for its K, e.g. the attention scores q k^T (K = head size)
    bandwidth     the data sheet's, or a copy benchmark's measured best where one was measured
                  (`stream_bandwidth`: no kernel reaches the data sheet's HBM figure)

Element-wise operators (layer norms, the softmax, GeLU, dropouts, residual adds, fused as
Megatron-LM fuses them) move their bytes at the memory bandwidth; a layer norm at its kernel's
measured throughput where one was measured on the device (`norm_bandwidth`: forward over its input
read and output written, backward over its input and output gradient read and input gradient
written; a layer norm kernel reads its rows twice, for their statistics and to normalize them, and
reduces them in warps, short of a copy's bandwidth). No efficiency is fitted: the device's peak, SM
count and bandwidth are its data sheet's; a measured GEMM rate, copy bandwidth or layer norm
throughput is a benchmark's, never fitted to the training throughput being predicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Gpu", "gemm_s", "memory_s", "norm_s", "BlockTimes", "block_times", "head_times"]

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
PIPELINE_K = 3 * 32


@dataclass(frozen=True)
class Gpu:
    """What the roofline reads of a GPU: tensor-core peak, SMs, memory bandwidth, element size, and
    a GEMM benchmark's best rate and its shape (M, N, K), and a copy benchmark's bandwidth, where
    they were measured."""

    peak_flops: float
    sms: int
    memory_bandwidth: float
    dtype_bytes: int = 2
    measured_flops: float = 0.0
    measured_shape: tuple[int, int, int] = (0, 0, 0)
    stream_bandwidth: float = 0.0
    norm_bandwidth: tuple[float, float] = (0.0, 0.0)  # a layer norm's forward, backward bytes/s (0: bandwidth)

    @property
    def bandwidth(self) -> float:
        """Bytes/s the roofline moves memory at: the measured copy bandwidth, else the data sheet's."""
        return self.stream_bandwidth or self.memory_bandwidth

    @property
    def rate(self) -> float:
        """The tensor cores' sustained FLOP/s (see the module): peak, or the measured best over
        the roofline's own shape terms at the measured shape (never above peak)."""
        if self.measured_flops <= 0:
            return self.peak_flops
        m, n, k = self.measured_shape
        flops = 2.0 * m * n * k
        main_loop = flops / self.measured_flops - m * n * self.dtype_bytes / self.bandwidth  # less the epilogue
        if main_loop <= 0:
            return self.peak_flops
        return min(self.peak_flops, flops / (main_loop * quantization(m, n, 1, self.sms) * k / (k + PIPELINE_K)))


def quantization(m: int, n: int, batch: int, sms: int) -> float:
    """The share of the tensor cores' work that is useful, for the best of cuBLAS's tiles."""
    best = 0.0
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / sms)
        best = max(best, m * n * batch / (waves * sms * tm * tn))
    return best


def gemm_s(m: int, n: int, k: int, gpu: Gpu, batch: int = 1) -> float:
    """Seconds for `batch` GEMMs of (m x k) @ (k x n) on `gpu` (see the module)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    compute = flops / (gpu.rate * quantization(m, n, batch, gpu.sms) * k / (k + PIPELINE_K))
    reads = (m * k + k * n) * batch * gpu.dtype_bytes / gpu.bandwidth
    roofline = max(compute, reads) + m * n * batch * gpu.dtype_bytes / gpu.bandwidth
    return max(roofline, flops / gpu.measured_flops) if gpu.measured_flops > 0 else roofline


def memory_s(nbytes: float, gpu: Gpu) -> float:
    """Seconds to read and write `nbytes` in all at the memory bandwidth."""
    return nbytes / gpu.bandwidth


def norm_s(values: float, gpu: Gpu) -> tuple[float, float]:
    """Forward and backward seconds of a layer norm over `values` elements: the forward reads them
    and writes its output, the backward reads them and the output's gradient and writes theirs; at
    the kernel's measured throughput where one was measured, else twice their bytes each way at the
    memory bandwidth (as the other element-wise operators)."""
    nbytes = values * gpu.dtype_bytes
    forward_bw, backward_bw = gpu.norm_bandwidth
    forward = 2 * nbytes / forward_bw if forward_bw > 0 else memory_s(2 * nbytes, gpu)
    backward = 3 * nbytes / backward_bw if backward_bw > 0 else memory_s(4 * nbytes, gpu)
    return forward, backward


@dataclass(frozen=True)
class BlockTimes:
    """One sequence's forward, input-gradient (B) and weight-gradient (W) seconds on one rank."""

    forward_s: float
    backward_s: float
    weight_s: float


def _linear(tokens: int, n: int, k: int, gpu: Gpu) -> BlockTimes:
    """y = x W (x: tokens x k, W: k x n): forward, input gradient, weight gradient."""
    return BlockTimes(gemm_s(tokens, n, k, gpu), gemm_s(tokens, k, n, gpu), gemm_s(k, n, tokens, gpu))


def block_times(seq: int, hidden: int, heads: int, gpu: Gpu, tp: int = 1) -> BlockTimes:
    """A transformer block on one of `tp` ranks (Megatron's layout: q|k|v and the first MLP linear
    split by columns, the output linears by rows, heads split; norms and residuals whole), one
    sequence of `seq` tokens."""
    s, h, a, d = seq, hidden, heads, gpu.dtype_bytes
    lin = [_linear(s, 3 * h // tp, h, gpu), _linear(s, h, h // tp, gpu),
           _linear(s, 4 * h // tp, h, gpu), _linear(s, h, 4 * h // tp, gpu)]
    head_dim, local_heads = h // a, a // tp
    scores = gemm_s(s, s, head_dim, gpu, local_heads)  # q k^T
    values = gemm_s(s, head_dim, s, gpu, local_heads)  # softmax(...) v
    # backward of each: two GEMMs of the same size (the gradients of both operands)
    attention_b = 2 * scores + 2 * values
    # element-wise bytes read + written, forward: 2 fused bias-dropout-adds (+ a 1-byte mask), the
    # fused bias-GeLU, the fused scale-mask-softmax, the attention dropout; the backward twice them;
    # and 2 layer norms (`norm_s`)
    elementwise = (2 * (3 * d + 1) * s * h + 2 * 4 * s * h * d / tp
                   + 2 * local_heads * s * s * d + local_heads * s * s * (2 * d + 1))
    norm_f, norm_b = norm_s(s * h, gpu)
    forward = sum(x.forward_s for x in lin) + scores + values + memory_s(elementwise, gpu) + 2 * norm_f
    backward = sum(x.backward_s for x in lin) + attention_b + memory_s(2 * elementwise, gpu) + 2 * norm_b
    return BlockTimes(forward, backward, sum(x.weight_s for x in lin))


def head_times(seq: int, hidden: int, vocab: int, gpu: Gpu, tp: int = 1) -> BlockTimes:
    """The final layer norm, the vocabulary projection (split by vocabulary rows on `tp` ranks) and
    the softmax cross-entropy over its logits (fp32), one sequence."""
    s, h, v, d = seq, hidden, vocab // tp, gpu.dtype_bytes
    proj = _linear(s, v, h, gpu)
    norm_f, norm_b = norm_s(s * h, gpu)
    loss = memory_s(2 * s * v * (d + 4), gpu)  # logits read, fp32 probabilities written, and back
    return BlockTimes(proj.forward_s + norm_f + loss, proj.backward_s + norm_b + loss, proj.weight_s)
