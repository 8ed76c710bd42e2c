"""Measuring a GPU into a device: what is kept of each run, the arithmetic, and the errors (on the CPU)."""

from __future__ import annotations

import pytest
import torch

from plait.cost.devices import KERNELS_PER_PASS, device
from plait.errors import ConfigError
from plait.cli import gpu_probe
from plait.cli.gpu_probe import ProbeSizes, measure_device, norm_throughput

CPU = torch.device("cpu")
TINY = ProbeSizes(matmuls=((32, 32, 32), (64, 32, 16)), copy_bytes=2**16, norm=(16, 64), launches=20)


def test_each_figure_keeps_the_best_of_the_runs_and_the_rest_is_the_preset(monkeypatch):
    runs = iter(range(3))
    picks = {"matmul": [(1e12, (1, 2, 3)), (3e12, (4, 5, 6)), (2e12, (7, 8, 9))], "copy": [5e11, 4e11, 6e11],
             "norm": [(1e11, 9e10), (3e11, 5e10), (2e11, 7e10)], "gap": [3e-6, 1e-6, 2e-6]}
    state = {}

    def matmul(dev, dtype, shapes, reps):
        state["run"] = next(runs)
        assert (dtype, shapes, reps) == (torch.bfloat16, TINY.matmuls, 4)
        return picks["matmul"][state["run"]]

    monkeypatch.setattr(gpu_probe, "best_matmul", matmul)
    monkeypatch.setattr(gpu_probe, "copy_bandwidth", lambda dev, nbytes, reps: picks["copy"][state["run"]])
    monkeypatch.setattr(gpu_probe, "norm_throughput", lambda r, h, dev, dtype, reps: picks["norm"][state["run"]])
    monkeypatch.setattr(gpu_probe, "kernel_gap", lambda dev, launches: picks["gap"][state["run"]])
    like = device("a100-80gb")
    mine = measure_device(like, CPU, runs=3, reps=4, sizes=TINY)
    assert (mine.gemm_flops, mine.gemm_shape, mine.stream_bandwidth) == (3e12, (4, 5, 6), 6e11)
    assert mine.norm_bandwidth == (3e11, 9e10)  # each direction's best, whichever run it came from
    assert mine.kernel_overhead_s == pytest.approx(KERNELS_PER_PASS * 1e-6)
    # what no benchmark here measures stays the preset's: peak, data sheet, links, element size
    for field in ("peak_flops", "memory_bandwidth", "network", "dtype_bytes", "efficiency", "sms", "memory_bytes"):
        assert getattr(mine, field) == getattr(like, field)
    assert mine.name == "measured cpu (like a100-80gb)"
    assert type(mine).from_dict(mine.to_dict()) == mine  # a device file round-trips


def test_a_real_run_on_the_cpu_gives_positive_figures_at_the_shapes_it_timed():
    mine = measure_device(device("h100-80gb"), CPU, runs=1, reps=2, sizes=TINY)
    assert mine.gemm_shape in TINY.matmuls and mine.gemm_flops > 0
    assert mine.stream_bandwidth > 0 and min(mine.norm_bandwidth) > 0 and mine.kernel_overhead_s > 0
    assert mine.gpu is not None and mine.gpu.norm_bandwidth == mine.norm_bandwidth


def test_the_layer_norm_throughput_counts_the_bytes_the_roofline_prices(monkeypatch):
    times = iter([1.0, 3.0])  # the forward alone, then forward and backward
    monkeypatch.setattr(gpu_probe, "timed", lambda fn, reps, dev: next(times))
    forward, backward = norm_throughput(16, 64, CPU, torch.float32, 1)
    nbytes = 16 * 64 * 4
    assert (forward, backward) == (2 * nbytes / 1.0, 3 * nbytes / 2.0)  # roofline.norm_s: 2 and 3 x the bytes


def test_bad_requests_say_what_to_do_instead(monkeypatch):
    with pytest.raises(ConfigError, match="'cpu' is timed by its FLOP/s"):
        measure_device(device("cpu"), CPU)
    with pytest.raises(ConfigError, match="runs and reps must be >= 1, got runs=0"):
        measure_device(device("a100-80gb"), CPU, runs=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"no CUDA device is visible here .*device\('a100-80gb'\).to_dict\(\)"):
        measure_device(device("a100-80gb"))
    with pytest.raises(ConfigError, match="launches in 1..900"):
        ProbeSizes(launches=1000)
    with pytest.raises(ConfigError, match="must be positive"):
        ProbeSizes(norm=(0, 64))


def test_a_two_byte_preset_is_timed_in_bf16_or_in_fp16_where_the_gpu_has_no_bf16_tensor_cores(monkeypatch):
    assert gpu_probe._dtype(2, CPU) == torch.bfloat16 and gpu_probe._dtype(4, CPU) == torch.float32
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert gpu_probe._dtype(2, cuda) == torch.bfloat16
    # a V100: bf16 only emulated, so its matmuls would not be what it trains at
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert gpu_probe._dtype(2, cuda) == torch.float16 and gpu_probe._dtype(4, cuda) == torch.float32
