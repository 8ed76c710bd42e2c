"""Keeping freed host memory (`plait.job.host_memory`) against glibc's default, on data-parallel steps.

Jobs spawned here, 2 gloo ranks on 127.0.0.1, one CPU thread each, alternating: plait as it
runs (large freed blocks kept for reuse), and the same with MALLOC_TRIM_THRESHOLD_=131072 in the
ranks' environment -- glibc's own default, which plait leaves alone when a user sets it -- so
malloc maps and unmaps every large buffer each step. The model: 4 x (Linear 1024->4096, GELU,
Linear 4096->1024), 33.6M parameters, batch 16, Adam; layouts dp=2 and dp=2 with ZeRO-1. Each
job times `--steps` steps after 3 (the slowest rank's), medians over all jobs of a side.

    python benchmarks/host_memory.py [--rounds 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from job import join_job, leave_job, run_job, timed  # noqa: E402 - benchmarks/ is on sys.path

SIDES = {"kept (plait)": {}, "glibc default": {"MALLOC_TRIM_THRESHOLD_": "131072"}}
LAYOUTS = {"dp=2": 0, "dp=2, ZeRO-1": 1}


def _rank(rank: int, port: int, zero: int, steps: int, result: str) -> None:
    import plait

    join_job(rank, 2, port)
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))])
    x, y = torch.randn(16, 1024), torch.randn(16, 1024)
    model = plait.Model(net, config=plait.Config(num_stages=1, dp=2, num_microbatches=1, zero=zero),
                        optimizer=torch.optim.Adam(net.parameters(), lr=1e-3), loss=nn.MSELoss())
    for _ in range(3):
        model.train_on_batch(x, y)
    times = [timed(lambda: model.train_on_batch(x, y)) for _ in range(steps)]
    if rank == 0:
        Path(result).write_text(" ".join(str(t) for t in times))
    leave_job()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {(s, lay): [] for s in SIDES for lay in LAYOUTS}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else reversed(SIDES):
            for layout, zero in LAYOUTS.items():
                saved = {k: os.environ.get(k) for k in SIDES["glibc default"]}
                os.environ.update(SIDES[side])  # the spawned ranks' glibc reads it at start-up
                try:
                    times[side, layout] += [float(t) for t in run_job(_rank, 2, zero, args.steps).split()]
                finally:
                    for k, v in saved.items():
                        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    print(f"{'layout':<14} {'kept ms':>9} {'default ms':>11} {'default / kept':>15}")
    for layout in LAYOUTS:
        kept, default = (statistics.median(times[s, layout]) for s in SIDES)
        print(f"{layout:<14} {1e3 * kept:>9.1f} {1e3 * default:>11.1f} {default / kept:>15.2f}")


if __name__ == "__main__":
    main()
