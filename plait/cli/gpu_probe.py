"""Measuring this machine's GPU for the planner: the constants of its roofline, by short benchmarks.

A GPU preset (`plait.cost.devices`) prices operators by `plait.cost.roofline` from a data sheet and
a few measured figures. `measure_device(like)` measures those figures on the GPU here and returns
the preset `like` with them put in, for `plait plan --device FILE.json` (`plait device` writes it):

    sms, memory_bytes      the device's own properties
    gemm_flops, gemm_shape the best matmul rate over `ProbeSizes.matmuls` and where it was reached
                           (Bekman's Maximum Achievable Matmul FLOPS, over fewer shapes), in the
                           preset's element type: bf16, fp16 where the GPU has no bf16 tensor cores
    stream_bandwidth       a copy's bytes read + written per second
    norm_bandwidth         PyTorch's layer norm at `ProbeSizes.norm`, forward and backward, over
                           the bytes `roofline.norm_s` counts
    kernel_overhead_s      `KERNELS_PER_PASS` x the gap a trivial kernel costs the GPU when
                           launched back to back behind a sleeping one (the host ahead, as behind
                           a large model's kernels)

Kept from `like`: the peak FLOP/s and the data sheet's bandwidth (a benchmark measures no peak), the
network (one GPU measures no links between GPUs) and the element size. Each timing is the median of
`reps` calls after warm-ups (CUDA events); of `runs` whole measurements the best rate and the
shortest gap are kept, as the presets keep the best of their runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from plait.cost.devices import KERNELS_PER_PASS, Device
from plait.errors import ConfigError

__all__ = ["SLEEP_CYCLES", "ProbeSizes", "timed", "best_matmul", "copy_bandwidth", "norm_throughput", "host_ahead_s",
           "kernel_gap", "measure_device"]

SLEEP_CYCLES = 2_000_000_000  # ~1 s at a 2 GHz clock: longer than the host takes to queue the launches


@dataclass(frozen=True)
class ProbeSizes:
    """What the probe times: matmuls (M, N, K), the bytes a copy moves, a layer norm's (rows,
    hidden), and the trivial kernels queued to time the gap (CUDA holds about a thousand launches;
    past that the host waits for the GPU)."""

    matmuls: tuple[tuple[int, int, int], ...] = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384),
                                                 (2048, 2048, 13312), (1024, 10240, 5120), (4096, 4096, 16384))
    copy_bytes: int = 2**30
    norm: tuple[int, int] = (4096, 12288)  # a Megatron-LM row's tokens x hidden (the presets' shape)
    launches: int = 500

    def __post_init__(self) -> None:
        if not self.matmuls or min(min(s) for s in self.matmuls) < 1 or min(self.norm) < 1:
            raise ConfigError(f"probe sizes must be positive: matmuls {self.matmuls}, norm {self.norm}")
        if self.copy_bytes < 1 or not 1 <= self.launches <= 900:
            raise ConfigError(f"probe copy_bytes must be >= 1 and launches in 1..900 (the launch queue), got "
                              f"{self.copy_bytes}, {self.launches}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], reps: int, dev: torch.device) -> float:
    """Median seconds of `reps` calls of `fn` on `dev`, after 3 warm-ups (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def best_matmul(dev: torch.device, dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...],
                reps: int) -> tuple[float, tuple[int, int, int]]:
    """The best FLOP/s of `a @ b` over `shapes` (M, N, K), and the shape that reached it."""
    best = (0.0, (0, 0, 0))
    for m, n, k in shapes:
        a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
        rate = 2.0 * m * n * k / timed(lambda: a @ b, reps, dev)
        best = max(best, (rate, (m, n, k)))
        del a, b
    return best


def copy_bandwidth(dev: torch.device, nbytes: int, reps: int) -> float:
    """Bytes/s (read + written) a copy of `nbytes` reaches."""
    big = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return 2 * nbytes / timed(lambda: big.clone(), reps, dev)


def norm_throughput(rows: int, hidden: int, dev: torch.device, dtype: torch.dtype, reps: int) -> tuple[float, float]:
    """A layer norm's forward and backward bytes/s over (rows, hidden): the forward's input read and
    output written, the backward's input and output gradient read and input gradient written (the
    counts of `plait.cost.roofline.norm_s`)."""
    norm = nn.LayerNorm(hidden).to(dev, dtype)
    x = torch.randn(rows, hidden, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    forward = timed(lambda: norm(x), reps, dev)
    both = timed(lambda: norm(x).backward(grad), reps, dev)
    nbytes = x.numel() * x.element_size()
    return 2 * nbytes / forward, 3 * nbytes / max(both - forward, 1e-9)


def host_ahead_s(fn: Callable[[], object], calls: int, dev: torch.device) -> tuple[float, float]:
    """The GPU's seconds per call of `fn`, `calls` of them queued behind a sleep kernel so that the
    host's dispatch is hidden; and the host's seconds per call while queueing them. On a CPU both
    are the host's time per call."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        took = (time.perf_counter() - t0) / calls
        return took, took
    for _ in range(3):  # the first launches load their kernels (lazily), which waits for the GPU
        fn()
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()  # after the sleep: what follows was queued while it ran
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls, host


def kernel_gap(dev: torch.device, launches: int) -> float:
    """Seconds a trivial kernel costs the GPU, launched back to back with the host ahead."""
    one = torch.zeros(1, device=dev)
    return host_ahead_s(lambda: one.add_(1.0), launches, dev)[0]


def _dtype(dtype_bytes: int, dev: torch.device) -> torch.dtype:
    """The element type a preset of `dtype_bytes` trains in: 4 fp32; 2 bf16, or fp16 on a GPU
    without bf16 tensor cores (a V100), where bf16 is emulated and not what training would use."""
    if dtype_bytes == 4:
        return torch.float32
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def measure_device(like: Device, dev: torch.device | None = None, runs: int = 3, reps: int = 10,
                   sizes: ProbeSizes = ProbeSizes()) -> Device:
    """`like` with this GPU's measured figures put in (see the module): the best of `runs`
    measurements, each timing the median of `reps` calls. `dev` defaults to the current CUDA device."""
    if not like.sms:
        raise ConfigError(f"measure a GPU like a GPU preset (one with SMs); {like.name!r} is timed by its "
                          "FLOP/s and calibrated on the job instead: pick a100-80gb, h100-80gb, ...")
    if runs < 1 or reps < 1:
        raise ConfigError(f"runs and reps must be >= 1, got runs={runs}, reps={reps}")
    if dev is None:
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device is visible here (torch.cuda.is_available() is False): measure on "
                              "a machine with the GPU, or write a device file from a preset by hand: "
                              "json.dump(device('a100-80gb').to_dict(), open('mine.json', 'w'))")
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = _dtype(like.dtype_bytes, dev)
    gemm, copy, norm_f, norm_b, gap = (0.0, (0, 0, 0)), 0.0, 0.0, 0.0, float("inf")
    for _ in range(runs):
        gemm = max(gemm, best_matmul(dev, dtype, sizes.matmuls, reps))
        copy = max(copy, copy_bandwidth(dev, sizes.copy_bytes, reps))
        forward, backward = norm_throughput(*sizes.norm, dev, dtype, reps)
        norm_f, norm_b = max(norm_f, forward), max(norm_b, backward)
        gap = min(gap, kernel_gap(dev, sizes.launches))
    sms, memory, name = like.sms, like.memory_bytes, f"measured {dev.type} (like {like.name})"
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        sms, memory, name = props.multi_processor_count, float(props.total_memory), f"{props.name} (like {like.name})"
    return replace(like, name=name, sms=sms, memory_bytes=memory, gemm_flops=gemm[0], gemm_shape=gemm[1],
                   stream_bandwidth=copy, norm_bandwidth=(norm_f, norm_b), kernel_overhead_s=KERNELS_PER_PASS * gap)
