"""A value crossing from a stage of tp=1 to one of tp=2 and its gradient back: as tiles or whole, measured and predicted.

One job, spawned here: 3 gloo ranks on 127.0.0.1, one CPU thread each; stage A is rank 0, stage B
ranks 1 and 2 (`plait.runtime.widths.crossing.Crossing`, the runtime's own code):

    tiles   rank 0 sends half the value to each rank of B, which all-gather it; the gradient comes
            back as two halves into rank 0 (Alpa's cross-mesh resharding with a local all-gather)
    whole   rank 0 sends all of it to each rank of B; nothing is gathered

For each size, the median over rounds (modes alternating) of one forward and backward crossing on
the slowest rank, beside what the cost model predicts for each way (`plait.cost.tiles.crossing_time`
on the links `plait.planner.calibrate` measures in the same job) and the way it would choose.

    python benchmarks/crossing.py [--rounds 15] [--sizes 16384,262144,1048576,4194304]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from job import join_job, leave_job, run_job, timed  # noqa: E402 - benchmarks/ is on sys.path

STAGE_A, STAGE_B = [0], [1, 2]
MODES = ("tiles", "whole")


def _rank(rank: int, port: int, rounds: int, sizes: list[int], result: str) -> None:
    from plait.plan.plan import CROSSINGS
    from plait.cost.tiles import crossing_time
    from plait.planner.calibrate import calibrate
    from plait.runtime.comm.collectives import make_group
    from plait.runtime.widths.crossing import Crossing
    from plait.runtime.comm.wire import Wire

    join_job(rank, 3, port)
    network = calibrate()
    group = make_group(STAGE_B)
    wire = Wire(timeout_s=120)
    crossings = {mode: Crossing(0, STAGE_A, STAGE_B, rank, group if rank in STAGE_B else None, whole=mode == "whole")
                 for mode in CROSSINGS}
    lines = [f"{'floats':>9} {'MiB':>6} {'tiles ms':>9} {'whole ms':>9} {'whole/tiles':>11} "
             f"{'pred tiles':>10} {'pred whole':>10}  measured  predicted"]
    agree = 0
    for size in sizes:
        value = torch.randn(size, requires_grad=True)
        grad = torch.randn(size)
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds + 1):  # round 0 sends the descriptions: not timed
            for mode in MODES if r % 2 else MODES[::-1]:
                crossing, tag = crossings[mode], 4 * (r % 2) + 2 * MODES.index(mode)
                key = ("F", size, mode)

                def step() -> None:
                    if crossing.sending:
                        crossing.send_forward([value], wire, key, tag)
                        crossing.recv_backward([value], wire, tag + 1)
                    else:
                        crossing.recv_forward(wire, key, tag)
                        crossing.send_backward([grad], wire, tag + 1)
                    wire.drain()

                seconds = timed(step)
                if r:
                    times[mode].append(seconds)
        measured = {mode: statistics.median(times[mode]) for mode in MODES}
        nbytes = 4.0 * size
        link, local = network.link(STAGE_A + STAGE_B), network.reduce_link(STAGE_B)
        predicted = {mode: crossing_time(nbytes, 1, 2, link, local, mode == "whole")
                     + crossing_time(nbytes, 2, 1, link, network.reduce_link(STAGE_A), mode == "whole")
                     for mode in MODES}
        faster, chosen = min(MODES, key=measured.__getitem__), min(MODES, key=predicted.__getitem__)
        agree += faster == chosen
        lines.append(f"{size:>9} {nbytes / 2**20:>6.2f} {1e3 * measured['tiles']:>9.3f} {1e3 * measured['whole']:>9.3f} "
                     f"{measured['whole'] / measured['tiles']:>11.2f} {1e3 * predicted['tiles']:>10.3f} "
                     f"{1e3 * predicted['whole']:>10.3f}  {faster:>8}  {chosen:>9}")
    lines.append(f"the cost model chose the faster way for {agree} of {len(sizes)} sizes")
    if rank == 0:
        Path(result).write_text("\n".join(lines))
    leave_job()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="16384,262144,1048576,4194304", help="floats per value, comma-separated")
    args = parser.parse_args()
    print(run_job(_rank, 3, args.rounds, [int(s) for s in args.sizes.split(",")]))


if __name__ == "__main__":
    main()
