"""plait on a GPU: a rank on CUDA through the runtime, against one process, and its step time.

Needs a CUDA device (a machine with one GPU is enough); CI never runs it. Three parts:

1. Equality on CUDA: a Hugging Face GPT-2 (4 layers x 256, vocabulary 1024) built on the meta
   device, trained 3 Adam steps by `plait.Model` in a one-rank NCCL group (the rank computes on
   its CUDA device: the model materialized there, the micro-batches and the optimizer on it),
   against `plait.materialize` of the same model trained by plain PyTorch on the CPU. Printed:
   the largest parameter difference (TF32 off), and `memory_stats()` on the GPU beside the
   allocator's own peak.
2. Step time on the GPU: the 160M GPT-2 of benchmarks/memory.py, plait's step (one rank, one
   stage, 2 micro-batches) against plain PyTorch's step on the same 2 micro-batches, alternating,
   medians of `--steps`: the ratio is plait's runtime overhead on a GPU.
3. NCCL with two ranks on one GPU: whether NCCL lets them share the device (it refuses duplicate
   GPUs in one communicator), so whether a multi-rank pipeline can run on a one-GPU machine.

    python benchmarks/gpu.py [--steps 10]
"""

from __future__ import annotations

import argparse
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
import torch.distributed as dist
from job import one_rank_group  # noqa: E402 - benchmarks/ is the script's own directory on sys.path


def gpt2(layers: int, width: int, heads: int, vocab: int, meta: bool) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                                     n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    if meta:
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(config)
    return transformers.GPT2LMHeadModel(config)


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def tokens(rows: int, seq: int, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(step))
    return x, torch.roll(x, -1, dims=1)


def equality() -> None:
    import plait

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    net = gpt2(4, 256, 4, 1024, meta=True)
    adam = {"lr": 1e-3, "eps": 1e-3}  # eps as in the equality tests: rounding residues stay small steps
    model = plait.Model(net, plait.Config(seed=0, num_microbatches=2),
                        optimizer=lambda ps: torch.optim.Adam(ps, **adam), loss=loss_fn)
    refs = {"one CPU process": plait.materialize(gpt2(4, 256, 4, 1024, meta=True), seed=0),
            "one process on the GPU": plait.materialize(gpt2(4, 256, 4, 1024, meta=True), seed=0).cuda()}
    opts = {name: torch.optim.Adam(ref.parameters(), **adam) for name, ref in refs.items()}
    for step in range(3):
        x, y = tokens(8, 64, 1024, step)
        model.train_on_batch(x, y)
        for name, ref in refs.items():
            device = next(ref.parameters()).device
            opts[name].zero_grad()
            for a in (0, 4):  # the same 2 micro-batches, mean loss
                (loss_fn(ref(x[a:a + 4].to(device)), y[a:a + 4].to(device)) / 2).backward()
            opts[name].step()
    devices = {str(p.device) for p in net.parameters()}
    state = model.state_dict()
    for name, ref in refs.items():
        diff = max(float((state[k] - v.to(state[k].device)).abs().max()) for k, v in ref.state_dict().items())
        print(f"equality: plait's rank on {sorted(devices)} vs {name}, 3 Adam steps: "
              f"largest parameter difference {diff:.2e}")
    stats = model.memory_stats()
    kinds = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_peak_bytes")
    print("memory_stats on the GPU (MiB): " + ", ".join(
        f"{k.removesuffix('_bytes')} {stats[k] / 2**20:.2f}" for k in kinds)
        + f"; their sum {sum(stats[k] for k in kinds) / 2**20:.2f}; the allocator's peak "
        f"{stats['device_peak_bytes'] / 2**20:.2f}")


def step_time(steps: int) -> None:
    import plait

    torch.backends.cuda.matmul.allow_tf32 = True
    rows, seq = 8, 512
    torch.manual_seed(0)
    net = gpt2(12, 1024, 16, 8192, meta=False).cuda()
    ref = gpt2(12, 1024, 16, 8192, meta=False).cuda()
    ref.load_state_dict(net.state_dict())
    model = plait.Model(net, plait.Config(num_microbatches=2), optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4),
                        loss=loss_fn)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-4)
    x, y = tokens(rows, seq, 8192, 0)
    xc, yc = x.cuda(), y.cuda()

    def plain() -> None:
        opt.zero_grad()
        for a in range(0, rows, rows // 2):  # the same 2 micro-batches, mean loss
            (loss_fn(ref(xc[a:a + rows // 2]), yc[a:a + rows // 2]) / 2).backward()
        opt.step()

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(3):  # warm-up (and plait's capture, profile and build)
        model.train_on_batch(x, y)
        plain()
    mine, theirs = [], []
    for _ in range(steps):
        mine.append(timed(lambda: model.train_on_batch(x, y)))
        theirs.append(timed(plain))
    a, b = statistics.median(mine), statistics.median(theirs)
    params = sum(p.numel() for p in net.parameters()) / 1e6
    print(f"step time, GPT-2 {params:.1f}M, {rows} x {seq} tokens, 2 micro-batches, fp32 (TF32 on), "
          f"median of {steps}: plait {1e3 * a:.1f} ms, plain PyTorch {1e3 * b:.1f} ms, ratio {a / b:.3f}")
    print(f"  plait memory_stats on the GPU: allocator peak {model.memory_stats()['device_peak_bytes'] / 2**30:.2f} GiB")


TWO_RANKS = """
import torch, torch.distributed as dist
dist.init_process_group("nccl"); torch.cuda.set_device(0)
t = torch.ones(4, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize()
print("rank", dist.get_rank(), "all_reduce ok, sum", float(t[0])); dist.destroy_process_group()
"""


def two_ranks_one_gpu() -> None:
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(TWO_RANKS)
        script.flush()
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script.name],
                             capture_output=True, text=True, timeout=180)
    said = [line for line in (run.stdout + run.stderr).splitlines()
            if "all_reduce ok" in line or "Duplicate GPU" in line or "DistBackendError" in line]
    print(f"NCCL, 2 ranks on one GPU: exit {run.returncode}")
    for line in said[:4]:
        print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs one")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    one_rank_group()
    equality()
    step_time(args.steps)
    dist.destroy_process_group()
    two_ranks_one_gpu()


if __name__ == "__main__":
    main()
