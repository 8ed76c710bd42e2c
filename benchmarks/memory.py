"""Peak memory of a rank against one process: a 160M-parameter GPT-2, Adam.

One process: plain PyTorch, the model built as usual, `--steps` Adam steps on batches of
`--rows` x `--seq` tokens; its peak RSS (`ru_maxrss`, the process's high-water mark) is the
baseline. plait: `--stages` x `--dp` gloo ranks on 127.0.0.1, the model built on the meta device
(nothing allocated), each rank materializing only its stage (`plait.Model`, `Config(zero=1)`:
the optimizer state sharded over the replicas), the same steps. The figure is the LARGEST
rank's peak RSS over the one process's, target <= 0.5 (<= 0.45 with `--zero 3`, the parameters
sharded too: `--stages 1 --dp 4 --zero 3`). Each side runs in a fresh process, so
neither inherits the other's allocations; both import torch and transformers the same way.

With --cap F, the same run again under a memory cap of F x the one process's peak (default 0.6):
each process in its own cgroup (v1 memory controller, memory.limit_in_bytes; the kernel kills a
process that goes over): first one process, which should be killed, then every plait rank, each
under the same cap, which should train. That works only if no rank ever materializes the whole
model. It needs a writable /sys/fs/cgroup/memory (root); without one it says so and fails.

The model: GPT-2 (transformers' GPT2LMHeadModel), 12 layers x 1024, 16 heads, vocabulary 8192,
1024 positions: 160.2M parameters (641 MB in fp32; with gradients and Adam's two moments,
2.6 GB before activations).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch

TARGET = 0.5
TARGET_ZERO3 = 0.45  # zero=3 at dp=4 x 1 stage: parameters sharded too
KINDS = ("parameters_bytes", "gradients_bytes", "gradients_at_step_bytes", "optimizer_bytes", "activations_peak_bytes")
CGROUPS = Path("/sys/fs/cgroup/memory")


def join_cgroup(path: str | None) -> None:
    """Put this process under the cap of cgroup `path` (made by `capped`) before it allocates."""
    if path:
        Path(path, "cgroup.procs").write_text(str(os.getpid()))


def capped(name: str, cap_bytes: int) -> str:
    """A fresh memory cgroup `name` limited to `cap_bytes`; its path."""
    path = CGROUPS / name
    path.mkdir(exist_ok=True)
    Path(path, "memory.limit_in_bytes").write_text(str(cap_bytes))
    return str(path)


def gpt2(meta: bool, layers: int = 12, hidden: int = 1024) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=16, vocab_size=8192, n_positions=1024,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    if meta:
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(config)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 8192, (args.rows, args.seq), generator=g)  # (B, T)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one_process(args: argparse.Namespace) -> dict[str, Any]:
    join_cgroup(args.cgroup)
    torch.set_num_threads(1)
    net = gpt2(meta=False)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(args, step)
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    return {"peak_mb": peak_mb(), "params": sum(p.numel() for p in net.parameters()),
            "seconds": time.perf_counter() - start}


def rank_main(rank: int, args: argparse.Namespace, out: str) -> None:
    join_cgroup(f"{args.cgroup}{rank}" if args.cgroup else None)
    torch.set_num_threads(1)
    import plait

    net = gpt2(meta=True)
    config = plait.Config(num_stages=args.stages, dp=args.dp, zero=_zero(args), num_microbatches=2,
                          timeout_s=600.0)
    model = plait.Model(net, config, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), loss=loss_fn)
    for step in range(args.steps):
        model.train_on_batch(*batch(args, step))
    stats = model.memory_stats()  # measured, with the predictions
    Path(out, f"{rank}.json").write_text(json.dumps({
        "peak_mb": peak_mb(), "layers": list(model.plan.layers_per_stage),
        **{key: stats[key] / 2**20 for key in KINDS},
        **{f"predicted_{key}": None if stats["predicted"][key] is None else stats["predicted"][key] / 2**20
           for key in KINDS}}))


def spawn_ranks(args: argparse.Namespace, cgroup: str | None = None) -> list[dict[str, Any]]:
    """The plait job: `stages x dp` ranks, each its own process (`--rank-main`), gloo on 127.0.0.1,
    rank r in cgroup `{cgroup}{r}` if given."""
    world = args.stages * args.dp
    with tempfile.TemporaryDirectory() as out:
        port = str(29500 + os.getpid() % 1000)
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", str(r), "--out", out,
                                   *_passed(args), *(["--cgroup", cgroup] if cgroup else [])],
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": port})
                 for r in range(world)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def _passed(args: argparse.Namespace) -> list[str]:
    return ["--stages", str(args.stages), "--dp", str(args.dp), "--steps", str(args.steps),
            "--rows", str(args.rows), "--seq", str(args.seq), "--zero", str(_zero(args))]


def _zero(args: argparse.Namespace) -> int:
    return (1 if args.dp > 1 else 0) if args.zero is None else args.zero


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, help="default: 1 with dp > 1")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4, help="rows of a global batch")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row")
    parser.add_argument("--rank-main", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=float, nargs="?", const=0.6, default=None,
                        help="then run again with every process capped at this fraction of the one "
                             "process's peak (default 0.6)")
    args = parser.parse_args(argv)
    if args.rank_main is not None:
        rank_main(args.rank_main, args, args.out)
        return 0
    if args.one_process:
        print(json.dumps(one_process(args)))
        return 0
    load = os.getloadavg()[0]
    alone = json.loads(subprocess.run([sys.executable, __file__, "--one-process", *_passed(args)],
                                      check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    ranks = spawn_ranks(args)
    print(f"GPT-2 {alone['params'] / 1e6:.1f}M parameters, Adam, {args.steps} steps of {args.rows} x {args.seq} "
          f"tokens; plait: {args.stages} stages x {args.dp} replicas, zero={_zero(args)}, built on meta")
    print("plait's ranks by `memory_stats()`, MB measured (predicted):")
    print("| process | peak RSS (MB) | parameters | gradients (backward) | gradients (step) | optimizer state | "
          "activations peak |")
    print("|---|---|---|---|---|---|---|")
    print(f"| one process (plain PyTorch) | {alone['peak_mb']:.0f} | {alone['params'] * 4 / 2**20:.0f} | "
          f"{alone['params'] * 4 / 2**20:.0f} | {alone['params'] * 4 / 2**20:.0f} | {alone['params'] * 8 / 2**20:.0f} | |")
    for r, got in enumerate(ranks):
        cells = " | ".join(f"{got[k]:.0f} ({'-' if got['predicted_' + k] is None else format(got['predicted_' + k], '.0f')})"
                           for k in KINDS)
        print(f"| plait rank {r} | {got['peak_mb']:.0f} | {cells} |")
    ratio = max(r["peak_mb"] for r in ranks) / alone["peak_mb"]
    target = TARGET_ZERO3 if _zero(args) == 3 else TARGET
    ok = ratio <= target
    print(f"largest rank / one process = {ratio:.3f} (target <= {target}): {'PASS' if ok else 'FAIL'}")
    if args.cap is not None:
        ok &= run_capped(args, int(args.cap * alone["peak_mb"] * 2**20))
    print(f"load average before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


def run_capped(args: argparse.Namespace, cap: int) -> bool:
    """One process, then the plait job, every process under `cap` bytes; True if the job trained."""
    if not os.access(CGROUPS, os.W_OK):
        print(f"memory cap: {CGROUPS} is not writable here (needs root and cgroup v1's memory controller): FAIL")
        return False
    stamp = f"plait-memory-{os.getpid()}-"
    alone = subprocess.run([sys.executable, __file__, "--one-process", *_passed(args),
                            "--cgroup", capped(stamp + "alone", cap)], capture_output=True, text=True)
    alone_died = alone.returncode != 0
    for r in range(args.stages * args.dp):
        capped(f"{stamp}rank{r}", cap)
    try:
        ranks, error = spawn_ranks(args, str(CGROUPS / f"{stamp}rank")), ""
    except SystemExit as e:
        ranks, error = [], str(e)
    for path in CGROUPS.glob(stamp + "*"):
        path.rmdir()
    print(f"\nunder a memory cap of {cap / 2**20:.0f} MB per process ({args.cap} x the one process's peak):")
    print(f"| run | outcome |\n|---|---|\n| one process | "
          f"{'killed (exit ' + str(alone.returncode) + ')' if alone_died else 'finished'} |")
    peaks = ", ".join(f"{r['peak_mb']:.0f}" for r in ranks)
    outcome = f"trained; peak RSS per rank (MB): {peaks}" if ranks else f"failed: {error}"
    print(f"| plait, {args.stages * args.dp} ranks | {outcome} |")
    ok = bool(ranks) and alone_died
    print(f"the plait job trains under a cap one process cannot: {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
