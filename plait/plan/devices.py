"""Device presets for planning clusters that are not here: compute, memory and network.

Every number is a published peak or a round assumption, named beside it; `efficiency` (the
share of peak a transformer's matmuls sustain in training) carries most of the uncertainty.
Memory is the device's total; the planner keeps a share free (`usable_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.plan.network import Link, Network

__all__ = ["Device", "DEVICES", "device"]

GIB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU process) and the network of the nodes it comes in."""

    name: str
    peak_flops: float  # dense matmul FLOP/s at `dtype_bytes` precision
    efficiency: float  # sustained share of peak in training
    memory_bytes: float
    memory_bandwidth: float  # bytes/s: the optimizer step is bound by it
    network: Network
    kernel_overhead_s: float  # fixed time per layer per pass (launches, small kernels)
    dtype_bytes: int = 2  # activations and parameters: 2 = fp16/bf16 mixed precision, 4 = fp32

    def __post_init__(self) -> None:
        if not (0 < self.efficiency <= 1):
            raise ConfigError(f"efficiency of {self.name} must be in (0, 1], got {self.efficiency!r}")
        if self.peak_flops <= 0 or self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ConfigError(f"device {self.name}: peak_flops, memory and bandwidth must be > 0")

    @property
    def flops(self) -> float:
        """Sustained FLOP/s: peak x efficiency."""
        return self.peak_flops * self.efficiency

    def usable_memory(self, fraction: float = 0.9) -> float:
        """Bytes left for the model: 10% kept for the runtime context, workspace, fragmentation."""
        return self.memory_bytes * fraction


def _gpu_node(intra_gbs: float, inter_gbs: float, per_node: int = 8) -> Network:
    """NVLink-class links inside a node (10 us), a network between nodes (30 us); GB/s."""
    return Network(Link(10e-6, intra_gbs * 1e9), Link(30e-6, inter_gbs * 1e9), per_node)


DEVICES: dict[str, Device] = {
    # V100 SXM2 16GB: 125 TFLOP/s fp16 tensor cores, 900 GB/s HBM2. Megatron-LM (2019) sustained
    # 39 TFLOP/s on one V100, about 30% of peak. Alpa's cluster (Zheng et al. 2022): p3.16xlarge,
    # 8 per node on NVLink (assumed ~100 GB/s NCCL bus bandwidth), 25 Gbit/s between nodes.
    "v100-16gb": Device("v100-16gb", 125e12, 0.30, 16 * GIB, 900e9,
                        _gpu_node(100, 25 / 8), 100e-6),
    # A100 SXM 40GB: 312 TFLOP/s bf16, 1555 GB/s. Megatron-LM (Narayanan et al. 2021, Table 1)
    # sustains 44-52% of peak; DGX A100: NVLink3 (~230 GB/s bus bandwidth), one 200 Gbit/s HDR per GPU.
    "a100-40gb": Device("a100-40gb", 312e12, 0.45, 40 * GIB, 1555e9, _gpu_node(230, 25), 50e-6),
    "a100-80gb": Device("a100-80gb", 312e12, 0.45, 80 * GIB, 2039e9, _gpu_node(230, 25), 50e-6),
    # H100 SXM 80GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3; NVLink4 (~360 GB/s bus bandwidth),
    # 400 Gbit/s NDR per GPU. 40% of peak is an assumption.
    "h100-80gb": Device("h100-80gb", 989e12, 0.40, 80 * GIB, 3350e9, _gpu_node(360, 50), 30e-6),
    # MI250X, one GCD (what a process sees): 191.5 TFLOP/s fp16/bf16 matrix, 64 GB HBM2e at
    # 1.6 TB/s; 8 GCDs per node (Frontier), Infinity Fabric ~50 GB/s between GCDs, 4 x 25 GB/s
    # Slingshot per node = 12.5 GB/s per GCD. 30% of peak is an assumption.
    "mi250x": Device("mi250x", 191.5e12, 0.30, 64 * GIB, 1600e9, _gpu_node(50, 12.5), 50e-6),
    # A CPU process of a few cores in fp32: ~100 GFLOP/s peak (4 cores x AVX2 FMA at ~3 GHz),
    # half of it sustained, 20 GB/s memory; up to 8 processes per host on loopback gloo
    # (~2 GB/s, 50 us; `plait.planner.calibrate` measures the real numbers), 10 GbE between.
    "cpu": Device("cpu", 100e9, 0.5, 16 * GIB, 20e9,
                  Network(Link(50e-6, 2e9), Link(100e-6, 1.25e9), 8), 20e-6, dtype_bytes=4),
}


def device(name: str) -> Device:
    """The preset called `name` (ValueError listing the presets when unknown)."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown device {name!r}; presets: {', '.join(sorted(DEVICES))}"
        ) from None
