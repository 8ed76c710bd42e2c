"""Waiting for gloo collectives: blocked (`Work.wait`) against polled (`plait.runtime.comm.waiting`), in one run.

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each. Each round runs, once with
PLAIT_WAIT=block and once with PLAIT_WAIT=poll (the order alternating), `--steps` iterations of

    compute + all-reduce   six 256 x 256 matrix products, then a 64 KiB SUM all-reduce (the
                           pattern of a tensor-parallel layer: compute, then a small collective)
    all-reduce N           an all-reduce of N alone, the ranks otherwise idle (64 KiB: a
                           tensor-parallel collective's size; 1 and 4 MiB: gradient buckets')

each waited for by `plait.runtime.comm.waiting.finish`, and the compute alone. Rank 0's iteration
times over all rounds: median, 90th percentile and mean, and the mean's ratio blocked / polled.

    python benchmarks/waiting.py [--rounds 6] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from job import join_job, leave_job, run_job  # noqa: E402 - benchmarks/ is on sys.path

MODES = ("block", "poll")
SIZES = {"64 KiB": 2**16, "1 MiB": 2**20, "4 MiB": 2**22}
KINDS = ("compute + all-reduce", *(f"all-reduce {name}" for name in SIZES), "compute")


def _rank(rank: int, port: int, rounds: int, steps: int, result: str) -> None:
    from plait.runtime.comm.waiting import WAIT_ENV, finish

    join_job(rank, 2, port)
    a, w = torch.randn(256, 256), torch.randn(256, 256)
    values = {name: torch.randn(n // 4) for name, n in SIZES.items()}

    def compute() -> None:
        x = a
        for _ in range(6):
            x = x @ w * 0.01

    def reduce(value: torch.Tensor) -> None:
        finish(dist.all_reduce(value, async_op=True))

    small = values["64 KiB"]
    bodies = {KINDS[0]: lambda: (compute(), reduce(small)), "compute": compute,
              **{f"all-reduce {name}": (lambda v=v: reduce(v)) for name, v in values.items()}}
    times: dict[tuple[str, str], list[float]] = {(m, k): [] for m in MODES for k in KINDS}
    for r in range(rounds + 1):  # round 0 warms up: not kept
        for mode in MODES if r % 2 else MODES[::-1]:
            os.environ[WAIT_ENV] = mode
            for kind, body in bodies.items():
                dist.barrier()
                for _ in range(steps):
                    start = time.perf_counter()
                    body()
                    if r:
                        times[mode, kind].append(time.perf_counter() - start)
    lines = [f"{'iteration':<22} {'wait':>5} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8}"]
    means: dict[tuple[str, str], float] = {}
    for kind in KINDS:
        for mode in MODES:
            ts = sorted(times[mode, kind])
            means[mode, kind] = statistics.mean(ts)
            lines.append(f"{kind:<22} {mode:>5} {1e3 * statistics.median(ts):>10.3f} "
                         f"{1e3 * ts[int(0.9 * (len(ts) - 1))]:>8.3f} {1e3 * means[mode, kind]:>8.3f}")
    for kind in KINDS[:-1]:
        lines.append(f"{kind}: blocked / polled mean {means['block', kind] / means['poll', kind]:.2f}")
    if rank == 0:
        Path(result).write_text("\n".join(lines))
    leave_job()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    print(run_job(_rank, 2, args.rounds, args.steps))


if __name__ == "__main__":
    main()
