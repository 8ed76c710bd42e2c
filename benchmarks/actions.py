"""Where a pipeline rank's step goes, action by action: messages by gloo against shared-memory rings, in one run.

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each, the model and schedule of
`pipeline_vs_torch.py` (8 x (Linear(512, 512) + ReLU) cut in the middle, batch 64 in 8
micro-batches, SGD). Two copies of the model are built, one whose messages go by gloo
(PLAIT_RINGS=0 while it is built) and one by the rings between the ranks of one host
(`plait.runtime.comm.rings`, the default); each round steps each of them `--steps` times, the
order alternating. Every action of the interpreter is timed on each rank, and so are the wire's
sends (isend) and posted receives inside them:

    F, B         a micro-batch's forward (with the loss on the last stage) and backward
    SF, SB       sending activations / input gradients (describing, packing, posting the send)
    RF, RB       taking activations / gradients (mostly waiting for the peer)
    post         posting receives ahead (inside the interpreter, before the action that needs them)
    send, recv   the transport's own isend / irecv calls (within SF/SB and posts)
    rest         the step's wall time less all of the above (the loop, the optimizer, the step's sums)

Printed: the median step (slowest rank) and, per rank, each kind's ms per step and us per call,
for both ways, and the step's ratio rings / gloo.

    python benchmarks/actions.py [--rounds 10] [--steps 20] [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plait

from job import join_job, leave_job, mlp, regression_batch, run_job  # noqa: E402 - benchmarks/ is on sys.path

WAYS = ("gloo", "rings")
KINDS = ("F", "B", "SF", "SB", "RF", "RB", "post", "send", "recv", "rest")


class Clock:
    """Seconds and calls per kind, for the way being stepped now."""

    def __init__(self) -> None:
        self.way = WAYS[0]
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.calls: dict[tuple[str, str], int] = collections.Counter()

    def wrap(self, owner: Any, name: str, kind: Callable[[tuple[Any, ...]], str]) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = (self.way, kind(args))
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        setattr(owner, name, timed)


def _instrument(clock: Clock) -> None:
    from plait.runtime import interpreter
    from plait.runtime.comm import rings, wire

    clock.wrap(interpreter.Interpreter, "_execute", lambda a: a[1].op.value)
    clock.wrap(interpreter.Interpreter, "_post", lambda a: "post")
    clock.wrap(wire.dist, "isend", lambda a: "send")
    clock.wrap(wire.dist, "irecv", lambda a: "recv")
    clock.wrap(rings.Rings, "isend", lambda a: "send")
    clock.wrap(rings.Rings, "irecv", lambda a: "recv")


def _rank(rank: int, port: int, rounds: int, steps: int, schedule: str, result: str) -> None:
    join_job(rank, 2, port)
    clock = Clock()
    _instrument(clock)
    x, y = regression_batch(64, 512, seed=1)
    models = {}
    for way in WAYS:
        os.environ["PLAIT_RINGS"] = "0" if way == "gloo" else "1"
        net = mlp(512, 8, seed=0)
        models[way] = plait.Model(net, config=plait.Config(layers_per_stage=(8, 8), num_microbatches=8,
                                                           schedule=schedule),
                                  optimizer=torch.optim.SGD(net.parameters(), lr=1e-3),
                                  loss=torch.nn.functional.mse_loss)
        models[way].train_on_batch(x, y)  # built, its messages described
        uses_rings = models[way]._train.pipe.interpreter.wire.rings is not None  # noqa: SLF001
        assert uses_rings == (way == "rings"), f"{way}: the model's wire has rings={uses_rings}"
    walls: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(rounds + 1):  # round 0 warms up
        if r == 1:
            clock.seconds.clear()
            clock.calls.clear()
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            clock.way = way
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                models[way].train_on_batch(x, y)
            wall = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            if r:
                walls[way].append(float(wall))
    total = rounds * steps
    mine = {way: sum(walls[way]) / rounds for way in WAYS}
    table = [[rank, way, kind, clock.seconds[(way, kind)] / total, clock.calls[(way, kind)] / total,
              clock.seconds[(way, kind)] / max(1, clock.calls[(way, kind)])] for way in WAYS for kind in KINDS[:-1]]
    for way in WAYS:
        inner = sum(clock.seconds[(way, k)] for k in ("F", "B", "SF", "SB", "RF", "RB", "post")) / total
        table.append([rank, way, "rest", mine[way] - inner, 1.0, mine[way] - inner])
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, table)
    if rank == 0:
        Path(result).write_text(_report(walls, gathered, rounds, steps, schedule))
    leave_job()


def _report(walls: dict[str, list[float]], tables: list[Any], rounds: int, steps: int, schedule: str) -> str:
    med = {way: statistics.median(walls[way]) * 1e3 for way in WAYS}
    lines = [f"{schedule}, 2 stages x 1 thread, 8 x (Linear(512, 512) + ReLU), batch 64 in 8 micro-batches, SGD; "
             f"{rounds} rounds of {steps} steps",
             "step (slowest rank, median of rounds): " + ", ".join(f"{w} {med[w]:.2f} ms" for w in WAYS)
             + f"; rings / gloo {med['rings'] / med['gloo']:.3f}", "",
             f"{'rank':>4} {'kind':>5} " + " ".join(f"{w + ' ms/step':>15} {'us/call':>9}" for w in WAYS)]
    for table in tables:
        rows = {(way, kind): (ms, per) for _, way, kind, ms, _, per in table}
        for kind in KINDS:
            cells = [rows[(w, kind)] for w in WAYS]
            if all(ms == 0 for ms, _ in cells):
                continue
            lines.append(f"{table[0][0]:>4} {kind:>5} " + " ".join(f"{ms * 1e3:>15.2f} {per * 1e6:>9.1f}"
                                                                  for ms, per in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args(argv)
    print(run_job(_rank, 2, args.rounds, args.steps, args.schedule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
