"""Device presets for planning clusters that are not here: compute, memory and network.

A GPU preset holds its data sheet's numbers (tensor-core peak, SMs, memory and its bandwidth,
links), each named beside it with its source (docs/planner.md lists them); its operators are
timed by `plait.cost.roofline`, with no efficiency factor; where a GEMM benchmark measured the
device's best matmul rate (Bekman, "Machine Learning Engineering", Maximum Achievable Matmul FLOPS
table, bf16, v2 run; for the V100 a published fp16 run; for the H200 this project's), the
roofline's GEMMs run at that rate rather than the data sheet's peak. The CPU preset keeps a sustained share
of peak (`efficiency`), which `plait.planner.calibrate` replaces with measured times. Memory is
the device's total; the planner keeps a share free (`usable_memory`). A GPU's fixed time per layer
and pass is the kernels a block launches per pass times the gap a kernel costs the GPU when the
host is ahead, both measured (`benchmarks/overhead_gpu.py`) on an H200 and an H100.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from plait.cost.network import Link, Network
from plait.cost.roofline import Gpu, gemm_s
from plait.errors import ConfigError

__all__ = ["Device", "DEVICES", "device"]

GIB = 2**30
# A GPU's fixed time per layer and pass: 67 kernels in a transformer block's forward and backward
# (21 + 46, eager PyTorch, by its profiler), a third of them a pass (F, B, W), each costing the GPU
# the gap of a trivial kernel launched back to back behind a sleeping one (so the host's dispatch
# is hidden, as behind a large model's kernels): 1.76 us on an H200, 2.12 us on an H100 80GB HBM3
# (benchmarks/overhead_gpu.py); the GPUs not measured take the slower of the two.
KERNELS_PER_PASS = 67 / 3
H200_PASS_S, H100_PASS_S = KERNELS_PER_PASS * 1.76e-6, KERNELS_PER_PASS * 2.12e-6
LAYER_PASS_S = H100_PASS_S


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
    sms: int = 0  # streaming multiprocessors (compute units): > 0 times operators by the roofline
    gemm_flops: float = 0.0  # a GEMM benchmark's best measured FLOP/s (0: none; the roofline uses peak)
    gemm_shape: tuple[int, int, int] = (0, 0, 0)  # the (M, N, K) it was measured at
    stream_bandwidth: float = 0.0  # a copy benchmark's best measured bytes/s (0: none; the data sheet's)
    norm_bandwidth: tuple[float, float] = (0.0, 0.0)  # a layer norm kernel's forward, backward bytes/s (0: none)
    host_link: float = 0.0  # bytes/s each way between the device and its host's memory (0: the device is the host)
    host_bandwidth: float = 0.0  # bytes/s of host memory per device of a node (an offloaded optimizer step's)

    def __post_init__(self) -> None:
        if not (0 < self.efficiency <= 1):
            raise ConfigError(f"efficiency of {self.name} must be in (0, 1], got {self.efficiency!r}")
        if self.peak_flops <= 0 or self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ConfigError(f"device {self.name}: peak_flops, memory and bandwidth must be > 0")

    @property
    def gpu(self) -> Gpu | None:
        """The roofline's view of a GPU preset (None: a CPU, timed by `flops`)."""
        if not self.sms:
            return None
        return Gpu(self.peak_flops, self.sms, self.memory_bandwidth, self.dtype_bytes, self.gemm_flops, self.gemm_shape,
                   self.stream_bandwidth, self.norm_bandwidth)

    @property
    def bandwidth(self) -> float:
        """Bytes/s memory-bound work moves at: a copy benchmark's measured best, else the data sheet's."""
        return self.stream_bandwidth or self.memory_bandwidth

    @property
    def flops(self) -> float:
        """Sustained FLOP/s: a GPU's on a large square GEMM by the roofline, else peak x efficiency."""
        gpu = self.gpu
        if gpu is not None:
            n = 8192
            return 2.0 * n**3 / gemm_s(n, n, n, gpu)
        return self.peak_flops * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        """The device as JSON-ready data (`from_dict` reads it back; `device("FILE.json")` loads it)."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["network"] = self.network.to_dict()
        data["gemm_shape"], data["norm_bandwidth"] = list(self.gemm_shape), list(self.norm_bandwidth)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Device":
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"not a device description: unknown keys {unknown}; its keys are {names}")
        values = dict(data)
        try:
            values["network"] = Network.from_dict(data["network"])
            values.update({key: tuple(data[key]) for key in ("gemm_shape", "norm_bandwidth") if key in data})
            return cls(**values)
        except (KeyError, TypeError) as err:
            raise ConfigError(f"device description {data.get('name', '?')!r} is incomplete or malformed "
                              f"({err}); write a preset's as a start: device('a100-80gb').to_dict()") from None

    def usable_memory(self, fraction: float = 0.9) -> float:
        """Bytes left for the model: 10% kept for the runtime context, workspace, fragmentation."""
        return self.memory_bytes * fraction


def _gpu_node(intra_gbs: float, inter_gbs: float, per_node: int = 8, reduce_gbs: float = 0.0) -> Network:
    """NVLink-class links inside a node, a network between nodes; GB/s. Latencies from NCCL's
    tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol, which NCCL runs for large
    messages): a collective's base 8.4 us once per call, 3.4 us a ring step on NVLink, 9.6 us a
    step over the network; a point-to-point message pays one step; NCCL also runs trees, and an
    all-reduce takes the faster of its ring and a tree. `reduce_gbs`: an all-reduce
    benchmark's bus bandwidth inside a node (nccl-tests' busbw, which is the ring formula's
    bandwidth), where one was measured; else the all-reduce runs at the link's."""
    base, nvlink, net = 8.4e-6, 3.4e-6, 9.6e-6
    reduce = Link(nvlink, reduce_gbs * 1e9, base, tree=True) if reduce_gbs else None
    return Network(Link(nvlink, intra_gbs * 1e9, base, tree=True), Link(net, inter_gbs * 1e9, base, tree=True),
                   per_node, reduce_intra=reduce)


DEVICES: dict[str, Device] = {
    # V100 SXM2 16GB (NVIDIA Tesla V100 whitepaper, 2017): 125 TFLOP/s fp16 tensor cores, 80 SMs,
    # 900 GB/s HBM2, six NVLink2 links of 25 GB/s each way = 150 GB/s. Alpa's cluster (Zheng et
    # al. 2022): AWS p3.16xlarge, 8 per node on NVLink, 25 Gbit/s between nodes. Measured best
    # fp16 matmul on a Tesla V100-SXM2-16GB: 97.36 TFLOP/s at 8192^3 (torch 2.7, square sizes
    # 1024-10240; zzc0721/torch-performance-test-data, issue 140).
    # Host side (offload): PCIe 3.0 x16, 15.75 GB/s each way (PCI-SIG: 8 GT/s x 16 lanes, 128b/130b);
    # DGX-1's two Xeon E5-2698 v4, 4 channels of DDR4-2400 each (76.8 GB/s a socket) shared by 8 GPUs.
    "v100-16gb": Device("v100-16gb", 125e12, 1.0, 16 * GIB, 900e9, _gpu_node(150, 25 / 8), LAYER_PASS_S, sms=80,
                        gemm_flops=97.36e12, gemm_shape=(8192, 8192, 8192), host_link=15.75e9,
                        host_bandwidth=2 * 76.8e9 / 8),
    # A100 SXM (NVIDIA A100 whitepaper, 2020): 312 TFLOP/s bf16, 108 SMs; 40GB: 1555 GB/s, 80GB:
    # 2039 GB/s (A100 80GB data sheet). DGX A100 (its user guide): NVSwitch, 600 GB/s per GPU both
    # ways = 300 GB/s each way; 8 x 200 Gbit/s HDR InfiniBand per node = 25 GB/s per GPU.
    # Measured best bf16 matmul (MAMF table): 271.2 TFLOP/s at 1024 x 10240 x 5120 (A100 SXM).
    # Measured all-reduce on 8 A100-SXM4-80GB over NVSwitch: ~200 GB/s busbw (nccl-tests issue 149).
    # Measured HBM read bandwidth of an A100 80GB SXM: 1.80 TB/s, 88% of the data sheet's in Nsight
    # Compute (NVIDIA developer forums, "Trouble to reach peak bandwidth of A100").
    # (A layer norm was measured on a GA100 only at 16384 x 1024, apex's kernel, 895.8 / 572.2 GB/s
    # forward / backward, apex pull request 1037; on an H200 PyTorch's ran 1.8-2x faster at a Megatron
    # row's 4096 x 12288 than at that shape, so it is not taken for Megatron's sizes.)
    # Host side (offload): PCIe 4.0 x16, 31.5 GB/s each way; DGX A100's two EPYC 7742, 8 channels of
    # DDR4-3200 each (204.8 GB/s a socket) shared by 8 GPUs.
    "a100-40gb": Device("a100-40gb", 312e12, 1.0, 40 * GIB, 1555e9, _gpu_node(300, 25, reduce_gbs=200), LAYER_PASS_S,
                        sms=108, gemm_flops=271.2e12, gemm_shape=(1024, 10240, 5120), host_link=31.5e9,
                        host_bandwidth=2 * 204.8e9 / 8),
    "a100-80gb": Device("a100-80gb", 312e12, 1.0, 80 * GIB, 2039e9, _gpu_node(300, 25, reduce_gbs=200), LAYER_PASS_S,
                        sms=108, gemm_flops=271.2e12, gemm_shape=(1024, 10240, 5120), stream_bandwidth=1800e9,
                        host_link=31.5e9, host_bandwidth=2 * 204.8e9 / 8),
    # H100 SXM 80GB (NVIDIA H100 data sheet): 989 TFLOP/s dense bf16, 132 SMs, 3.35 TB/s HBM3;
    # NVLink4 900 GB/s both ways = 450 each way; 400 Gbit/s NDR per GPU (DGX H100) = 50 GB/s.
    # Measured best bf16 matmul (MAMF table): 794.5 TFLOP/s at 2048 x 2048 x 13312 (H100 SXM).
    # NCCL's ring on NVLink4: ~370 GB/s busbw, the line rate less ~20% protocol (nccl-tests issue 212).
    # Measured on one H100 80GB HBM3 by benchmarks/roofline_gpu.py: copy 2.95 TB/s (read + written);
    # its best matmul there, 785.5 TFLOP/s at 8192^3, is below the MAMF table's, which is kept;
    # PyTorch's layer norm at 4096 x 12288: 1.37 TB/s forward, 0.74 backward, the best of four runs.
    # Host side (offload, DGX H100 and H200 alike): PCIe 5.0 x16, 63 GB/s each way; two Xeon Platinum
    # 8480C, 8 channels of DDR5-4800 each (307.2 GB/s a socket) shared by 8 GPUs.
    "h100-80gb": Device("h100-80gb", 989e12, 1.0, 80 * GIB, 3350e9, _gpu_node(450, 50, reduce_gbs=370), H100_PASS_S,
                        sms=132, gemm_flops=794.5e12, gemm_shape=(2048, 2048, 13312), stream_bandwidth=2950e9,
                        norm_bandwidth=(1.37e12, 0.74e12), host_link=63e9, host_bandwidth=2 * 307.2e9 / 8),
    # H200 SXM 141GB (NVIDIA H200 data sheet): the H100's 989 TFLOP/s dense bf16, 132 SMs and
    # NVLink4, 4.8 TB/s HBM3e; 143771 MiB as nvidia-smi reports it; DGX H200: 400 Gbit/s NDR per GPU.
    # Measured on one H200 by benchmarks/roofline_gpu.py (docs/benchmarks.md): best bf16 matmul
    # 785.7 TFLOP/s at 8192^3, copy 4.17 TB/s (read + written), the best of its runs; PyTorch's layer
    # norm at 4096 x 12288 (a Megatron row's tokens x hidden): 1.81 TB/s forward, 1.06 backward.
    "h200-141gb": Device("h200-141gb", 989e12, 1.0, 143771 * 2**20, 4800e9, _gpu_node(450, 50, reduce_gbs=370),
                         H200_PASS_S, sms=132, gemm_flops=785.7e12, gemm_shape=(8192, 8192, 8192),
                         stream_bandwidth=4170e9, norm_bandwidth=(1.81e12, 1.06e12), host_link=63e9,
                         host_bandwidth=2 * 307.2e9 / 8),
    # MI250X, one GCD (AMD Instinct MI250X data sheet; what a process sees): 191.5 TFLOP/s fp16/bf16
    # matrix, 110 CUs, 64 GB HBM2e at 1.6 TB/s; 8 GCDs per node (Frontier), Infinity Fabric
    # ~50 GB/s between GCDs, 4 x 25 GB/s Slingshot per node = 12.5 GB/s per GCD.
    # Measured best bf16 matmul on one GCD (MAMF table, v1 run): 147.0 TFLOP/s at 1024 x 19968 x 14080.
    # Host side (offload, Frontier's node): Infinity Fabric 36 GB/s each way between a GCD and the CPU;
    # one EPYC 7A53, 8 channels of DDR4-3200 (204.8 GB/s) shared by 8 GCDs.
    "mi250x": Device("mi250x", 191.5e12, 1.0, 64 * GIB, 1600e9, _gpu_node(50, 12.5), LAYER_PASS_S, sms=110,
                     gemm_flops=147.0e12, gemm_shape=(1024, 19968, 14080), host_link=36e9, host_bandwidth=204.8e9 / 8),
    # A CPU process of a few cores in fp32: ~100 GFLOP/s peak (4 cores x AVX2 FMA at ~3 GHz),
    # half of it sustained (an assumption: `plait.planner.calibrate` measures the real numbers),
    # 20 GB/s memory; up to 8 processes per host on loopback gloo (~2 GB/s, 50 us), 10 GbE between.
    "cpu": Device("cpu", 100e9, 0.5, 16 * GIB, 20e9,
                  Network(Link(50e-6, 2e9), Link(100e-6, 1.25e9), 8), 20e-6, dtype_bytes=4),
}


def device(name: str) -> Device:
    """The preset called `name`, or the device a JSON file `name` (ending in .json) describes, as
    `Device.to_dict` writes one: a cluster of your own, or a preset with your measured figures
    (ConfigError listing the presets when unknown)."""
    if name.lower().endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"device file {name!r} not found; write one from a preset, e.g. "
                              f"json.dump(device('a100-80gb').to_dict(), open({name!r}, 'w')), and edit it")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"device file {name!r} is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"device file {name!r} holds {type(data).__name__}, not a device's object")
        return Device.from_dict(data)
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown device {name!r}; presets: {', '.join(sorted(DEVICES))}, or a FILE.json "
            "describing one (Device.to_dict)"
        ) from None
