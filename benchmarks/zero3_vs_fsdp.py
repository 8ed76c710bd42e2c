"""plait's zero=3 against torch FSDP2 on the same model and batch: step time, peak memory, results.

4 gloo ranks on 127.0.0.1, one CPU thread each; a GPT-2 (transformers' GPT2LMHeadModel, default
12 layers x 1024, vocabulary 8192: 160M parameters), Adam, batches of `--rows` x `--seq` tokens:

    plait  plait.Model(net, Config(zero=3, num_stages=1, dp=4, num_microbatches=1, recompute=False)), train_on_batch
           on the global batch (plait gives each replica its rows)
    fsdp2  fully_shard on every transformer block and on the model (torch's FSDP2, its defaults),
           each rank its rows of the same batch, loss.backward(), Adam's step

Time: one job holds both; each round runs one step of each, plait first on even rounds, and a
step's time is the slowest rank's (after a barrier; all_reduce MAX). Medians over `--rounds`, and
the median of the per-round ratios ("paired"). Target: plait / fsdp2 <= 1.05. Before timing, both
train a few steps from the same initial values and their parameters are compared (rtol 1e-4:
the replicas' gradients are summed in another order).

Memory: each side again alone in fresh processes (a process's peak RSS is its high-water mark, so
the two cannot share one), the largest rank's peak RSS. Target: plait's <= fsdp2's. plait runs
twice: on the real model as above (one stage with its micro-batches, ZeRO level and recomputation
given: nothing to plan, so nothing is profiled; the whole model is built on each rank, as for
FSDP2), and built on the meta device ("plait-meta": each rank makes its stage).

    python benchmarks/zero3_vs_fsdp.py [--rounds 5] [--layers 12] [--hidden 1024] [--rows 4] [--seq 128] [--memory-only]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
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
import torch.distributed as dist
from memory import batch, loss_fn  # noqa: E402 - benchmarks/ is the script's own directory on sys.path
from memory import gpt2 as memory_gpt2  # noqa: E402

WORLD = 4
SIDES = ("plait", "plait-meta", "fsdp2")  # plait-meta: the model built on meta (each rank makes its own stage)
TARGET_TIME = 1.05


def gpt2(args: argparse.Namespace, meta: bool = False) -> torch.nn.Module:
    """`benchmarks/memory.py`'s GPT-2 at `--layers` x `--hidden` (on meta: plait materializes each
    rank's stage itself, by Config.seed, and profiles nothing)."""
    return memory_gpt2(meta, args.layers, args.hidden)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


class Fsdp2:
    """The peer: FSDP2 on every block and the model, this rank's rows of each batch."""

    def __init__(self, net: torch.nn.Module, rank: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for block in net.transformer.h:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        self.net, self.rank, self.opt = net, rank, adam(net.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        rows = len(x) // WORLD
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        self.opt.zero_grad()
        loss_fn(self.net(x[mine]), y[mine]).backward()  # FSDP2 averages the replicas' gradients
        self.opt.step()

    def state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().full_tensor() for name, p in self.net.named_parameters()}  # type: ignore[operator]


def plait_side(net: torch.nn.Module) -> Any:
    model = plait.Model(net, plait.Config(zero=3, num_stages=1, dp=WORLD, num_microbatches=1, recompute=False,
                                          timeout_s=900.0),
                        optimizer=adam, loss=loss_fn)
    return model


def timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def rank_main(rank: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    net = gpt2(args, meta=args.only == "plait-meta")
    result: dict[str, Any] = {}
    if args.only in (None, "plait", "plait-meta"):
        model = plait_side(copy.deepcopy(net) if args.only is None else net)
    if args.only in (None, "fsdp2"):
        peer = Fsdp2(net, rank)
    if args.only is None:
        for step in range(args.check_steps):  # the same steps from the same values, then compared
            x, y = batch(args, step)
            model.train_on_batch(x, y)
            peer.step(x, y)
        got, want = model.state_dict(), peer.state()
        result["max_diff"] = max(float((got[k] - v).abs().max()) for k, v in want.items())
        result["equal"] = all(torch.allclose(got[k], v, rtol=1e-4, atol=1e-5) for k, v in want.items())
        times: dict[str, list[float]] = {"plait": [], "fsdp2": []}
        for r in range(args.rounds):
            x, y = batch(args, 100 + r)
            order = [("plait", lambda: model.train_on_batch(x, y)), ("fsdp2", lambda: peer.step(x, y))]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                times[name].append(timed(fn))
        result["times"] = times
    else:
        for step in range(args.check_steps):
            x, y = batch(args, step)
            model.train_on_batch(x, y) if args.only != "fsdp2" else peer.step(x, y)
    result["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def spawn(args: argparse.Namespace, only: str | None) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        port = str(29600 + os.getpid() % 1000 + (0 if only is None else 1 + SIDES.index(only)))
        passed = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--rows", str(args.rows),
                  "--seq", str(args.seq), "--rounds", str(args.rounds), "--check-steps", str(args.check_steps)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", str(r), "--out", out, *passed,
                                   *(["--only", only] if only else [])],
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r),
                                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
                 for r in range(WORLD)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(WORLD)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check-steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4, help="rows of a global batch (a multiple of 4)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--only", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help="the peaks alone, no timed job")
    parser.add_argument("--rank-main", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main is not None:
        rank_main(args.rank_main, args, args.out)
        return 0
    load = os.getloadavg()[0]
    print(f"GPT-2 {args.layers} layers x {args.hidden}, Adam, batches of {args.rows} x {args.seq} tokens, "
          f"{WORLD} gloo ranks x 1 thread")
    ok_time = equal = True
    if not args.memory_only:
        both = spawn(args, None)
        times = both[0]["times"]
        mid = {name: statistics.median(t) for name, t in times.items()}
        paired = statistics.median(p / f for p, f in zip(times["plait"], times["fsdp2"]))
        equal = both[0]["equal"]
        print(f"results after {args.check_steps} steps: max |plait - fsdp2| = {both[0]['max_diff']:.2e} "
              f"({'equal' if equal else 'DIFFERENT'} within rtol 1e-4)")
        ratio = mid["plait"] / mid["fsdp2"]
        ok_time = ratio <= TARGET_TIME
        print(f"step time, median: plait {mid['plait']:.3f} s, fsdp2 {mid['fsdp2']:.3f} s; plait / fsdp2 = {ratio:.3f} "
              f"(paired {paired:.3f}; target <= {TARGET_TIME}): {'PASS' if ok_time else 'FAIL'}")
    peaks = {side: max(r["peak_mb"] for r in spawn(args, side)) for side in SIDES}
    print("largest rank's peak RSS, each side alone (MB):")
    for side in SIDES:
        print(f"  {side:<11} {peaks[side]:7.0f}   / fsdp2 = {peaks[side] / peaks['fsdp2']:.3f}")
    ok_memory = peaks["plait"] <= peaks["fsdp2"]
    print(f"plait (real model) / fsdp2 peak RSS = {peaks['plait'] / peaks['fsdp2']:.3f} (target <= 1): "
          f"{'PASS' if ok_memory else 'FAIL'}")
    print(f"load average before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0 if ok_time and ok_memory and equal else 1


if __name__ == "__main__":
    sys.exit(main())
