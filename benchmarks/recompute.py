"""Recomputation whole or layer by layer: peak memory and step time against keeping every activation.

A Hugging Face GPT-2 (`--layers` blocks, dropouts 0.1) trained by `plait.Model` in one process, one
stage, GPipe over `--microbatches` micro-batches (every micro-batch's activations held before the
first backward), three ways: no recomputation, the stage recomputed whole (`recompute=True`), and
recomputed layer by layer (`recompute_by_layer=True`). Each is first checked bit for bit equal to
the others after two steps (the same dropout masks drawn again). Printed per way: the peak memory
of a step -- on a GPU the CUDA allocator's peak above what the model holds before the step, on the
CPU the most bytes of tensor storage made during the step and alive at once (a dispatch-mode
tally) -- and the median step time of `--steps` alternating steps; then the ratios.

    python benchmarks/recompute.py [--layers 12] [--width 256] [--seq 512] [--rows 16] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
import transformers

import plait
from live_bytes import LiveBytes  # noqa: E402 - benchmarks/ is the script's own directory on sys.path
from job import one_rank_group  # noqa: E402 - benchmarks/ is the script's own directory on sys.path

WAYS = {"kept": {"recompute": False}, "whole": {"recompute": True, "recompute_by_layer": False},
        "by layer": {"recompute": True, "recompute_by_layer": True}}


def build(args: argparse.Namespace, device: torch.device, **way: Any) -> tuple[plait.Model, Any]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                     vocab_size=args.vocab, n_positions=args.seq, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    net = transformers.GPT2LMHeadModel(config)

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    model = plait.Model(net, plait.Config(num_microbatches=args.microbatches, schedule="gpipe", **way),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.01), loss=loss)
    x = torch.randint(0, args.vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(1))
    return model, (x, torch.roll(x, -1, dims=1))  # plait moves each micro-batch to its rank's device


def peak_bytes(model: plait.Model, batch: Any, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model.train_on_batch(*batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with LiveBytes() as live:
        model.train_on_batch(*batch)
    return live.peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:  # a plait rank on the GPU: a one-rank NCCL group; deterministic kernels, to compare bits
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        one_rank_group()
    print(f"GPT-2 {args.layers} x {args.width}, {args.rows} x {args.seq} tokens, GPipe over "
          f"{args.microbatches} micro-batches, one stage on {device.type}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ", one thread"))
    models = {name: build(args, device, **way) for name, way in WAYS.items()}
    states = {}
    for name, (model, batch) in models.items():
        torch.manual_seed(5)
        for _ in range(2):
            model.train_on_batch(*batch)
        states[name] = model.state_dict()
        print(f"  {name:<9} plan: recompute {list(model.plan.recompute)}, by layer {list(model.plan.recompute_by_layer)}")
    for name, state in states.items():
        for key, value in states["kept"].items():
            if not torch.equal(state[key], value):
                print(f"FAIL: {name} differs from kept at {key} by {(state[key] - value).abs().max().item():.3g}")
                return 1
    print("  states after 2 steps: equal bit for bit")
    peaks = {name: peak_bytes(model, batch, device) for name, (model, batch) in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.steps):
        for name, (model, batch) in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.train_on_batch(*batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    step = {name: statistics.median(t) for name, t in times.items()}
    for name in models:
        print(f"  {name:<9} peak {peaks[name] / 2**20:9.2f} MiB   step {step[name] * 1e3:9.2f} ms")
    print(f"by layer / whole peak memory = {peaks['by layer'] / peaks['whole']:.3f}, "
          f"by layer / kept = {peaks['by layer'] / peaks['kept']:.3f}")
    print(f"by layer / whole step time = {step['by layer'] / step['whole']:.3f}, "
          f"by layer / kept = {step['by layer'] / step['kept']:.3f}")
    ok = peaks["by layer"] < peaks["whole"]
    print(f"{'PASS' if ok else 'FAIL'}: layer by layer peaks below recomputing whole")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
