"""Measured step time and activation memory of plait's schedules against what the simulator predicts.

One job, spawned here: `--ranks` gloo ranks on 127.0.0.1, one CPU thread each, one pipeline
(stage s on rank s). The model is `--layers` x (Linear(width, width), ReLU), the loss a mean MSE,
the optimizer SGD. Every schedule trains its own copy with `Config(trace_dir=...)`; rounds run
the schedules one after another (the order rotated each round), every step after a barrier, its
time the slowest rank's.

Prediction: for each schedule, the trace of its own run gives each stage's mean F, B and W time
(a send's posting time counted in the F or B that made it), the hand-over time t_comm (from the
end of a send to the end of the receive that waited for it) and the optimizer step, and
`plait.schedule.simulate` turns those costs into a step time (plus the optimizer). The check is on ratios between
schedules, as the issue asks: (measured s / measured 1F1B) / (predicted s / predicted 1F1B) must
be within 1 +- 0.15.

Memory: the bytes of activations autograd saves for backward, live at once on each rank, are
counted with `torch.autograd.graph.saved_tensors_hooks` (a saved tensor counts until autograd
frees it; parameters are not counted). GPipe / 1F1B on stage 0 is compared with m / min(p, m).

    python benchmarks/schedules.py [--ranks 2] [--rounds 15] [--batch 64] [--microbatches 8]
                                   [--width 512] [--layers 8] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import plait
from job import join_job, leave_job, mlp, regression_batch, run_job
from plait.cli import timeline
from plait.schedule import simulate

SEED = 1234
LR = 1e-3
WARMUP_STEPS = 3
TOLERANCE = 0.15  # measured / predicted ratio between schedules: within 1 +- this
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved": {"num_virtual_stages": 2}, "zbh1": {}}


@dataclass(frozen=True)
class Setting:
    ranks: int
    rounds: int
    batch: int
    microbatches: int
    width: int
    layers: int
    trace_dir: str


def make_net(setting: Setting) -> nn.Sequential:
    return mlp(setting.width, setting.layers, SEED)


def make_batch(setting: Setting, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(setting.batch, setting.width, SEED + 1 + step)


class SavedBytes:
    """Bytes of tensors autograd holds for backward right now, and the peak since `reset`."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def reset(self) -> None:
        self.peak = self.live

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        counter = self

        class Held:
            __slots__ = ("tensor", "size")

            def __init__(self, tensor: torch.Tensor) -> None:
                self.tensor = tensor
                self.size = 0 if isinstance(tensor, nn.Parameter) else tensor.untyped_storage().nbytes()
                counter.live += self.size
                counter.peak = max(counter.peak, counter.live)

            def __del__(self) -> None:
                counter.live -= self.size

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


def timed_step(model: plait.Model, x: torch.Tensor, y: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    model.train_on_batch(x, y)
    wall = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return float(wall)


def _rank_main(rank: int, port: int, setting: Setting, result_path: str) -> None:
    join_job(rank, setting.ranks, port)
    try:
        models = {}
        for name, extra in SCHEDULES.items():
            config = plait.Config(schedule=name, num_microbatches=setting.microbatches,
                                  trace_dir=str(Path(setting.trace_dir) / name), **extra)
            models[name] = plait.Model(make_net(setting), config, loss=nn.functional.mse_loss,
                                       optimizer=lambda p: torch.optim.SGD(p, lr=LR))
        saved = SavedBytes()
        peaks: dict[str, int] = {}
        for name, model in models.items():
            for step in range(WARMUP_STEPS):
                model.train_on_batch(*make_batch(setting, step))
            base = saved.live
            saved.reset()
            with saved.hooks():
                model.train_on_batch(*make_batch(setting, 0))
            peaks[name] = saved.peak - base
        walls: dict[str, list[float]] = defaultdict(list)
        first_timed = {name: model._train.interpreter.runs + 1 for name, model in models.items()}  # type: ignore[union-attr]
        names = list(models)
        for r in range(setting.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                walls[name].append(timed_step(models[name], *make_batch(setting, r)))
        for model in models.values():
            model.write_trace()
        gathered: list[Any] = [None] * setting.ranks
        dist.all_gather_object(gathered, peaks)
        if rank == 0:
            Path(result_path).write_text(json.dumps({"walls": walls, "peaks": gathered,
                                                     "first_timed": first_timed}))
    finally:
        leave_job()


def profiled_costs(trace_dir: Path, first_step: int) -> tuple[dict[str, list[float]], float, float]:
    """Per-stage F, B, W time (ms; a send's posting time folded into the F or B that made it),
    the hand-over time and the optimizer's, each the median over the timed steps' means."""
    trace = timeline.load(trace_dir)
    steps = [k for k in trace.complete_steps() if k >= first_step]
    per_step = []
    for step in steps:
        compute, sends = timeline.stage_times(trace, step), timeline.send_times(trace, step)
        per_step.append({"F": [c + x for c, x in zip(compute["F"], sends["F"])],
                         "B": [c + x for c, x in zip(compute["B"], sends["B"])],
                         "W": compute["W"]})
    costs = {op: [statistics.median(c[op][i] for c in per_step) for i in range(len(per_step[0][op]))]
             for op in ("F", "B", "W")}
    comm = statistics.median(timeline.transfer_time(trace, step) for step in steps)
    optimizer = [s.end - s.start for spans in trace.spans.values() for s in spans
                 if s.op == "opt" and (s.step or 0) >= first_step]
    return costs, comm, statistics.median(optimizer) if optimizer else 0.0


def report(setting: Setting, result: dict[str, Any]) -> bool:
    p, m = setting.ranks, setting.microbatches
    measured = {name: statistics.median(w) * 1e3 for name, w in result["walls"].items()}
    predicted, profiles = {}, {}
    for name, extra in SCHEDULES.items():
        costs, comm, opt = profiled_costs(Path(setting.trace_dir) / name, result["first_timed"][name])
        sim = simulate(name, p, m, t_f=costs["F"], t_b=costs["B"], t_w=costs["W"], t_comm=comm,
                       num_virtual_stages=extra.get("num_virtual_stages", 1))
        predicted[name] = sim.step_time + opt
        profiles[name] = (costs, comm, opt)
    print(f"\n{setting.layers} x (Linear({setting.width}) + ReLU), batch {setting.batch} in {m} "
          f"micro-batches, {p} ranks x 1 thread; medians of {setting.rounds} rounds, ms")
    print(f"{'schedule':12s} {'measured':>9s} {'predicted':>9s} {'meas/1f1b':>9s} {'pred/1f1b':>9s} "
          f"{'agreement':>9s}")
    ok = True
    for name in SCHEDULES:
        mr, pr = measured[name] / measured["1f1b"], predicted[name] / predicted["1f1b"]
        agree = mr / pr
        ok &= abs(agree - 1) <= TOLERANCE
        print(f"{name:12s} {measured[name]:9.2f} {predicted[name]:9.2f} {mr:9.3f} {pr:9.3f} {agree:9.3f}")
    print("profiled per stage (ms): F, B, W with sends folded in; t_comm; optimizer")
    for name, (costs, comm, opt) in profiles.items():
        print(f"{name:12s} F {_fmt(costs['F'])}  B {_fmt(costs['B'])}  W {_fmt(costs['W'])}  "
              f"t_comm {comm:.2f}  opt {opt:.2f}")
    peaks = result["peaks"]
    print("\nactivation bytes saved for backward, peak per rank (MB):")
    for name in SCHEDULES:
        print(f"{name:12s} " + " ".join(f"{peaks[r][name] / 2**20:8.2f}" for r in range(p)))
    ratio = peaks[0]["gpipe"] / peaks[0]["1f1b"]
    expected = m / min(p, m)
    mem_ok = abs(ratio / expected - 1) <= TOLERANCE
    print(f"stage 0 GPipe / 1F1B: {ratio:.2f} (m / min(p, m) = {expected:.2f}): "
          f"{'PASS' if mem_ok else 'FAIL'}")
    print(f"schedule ratios within +-{TOLERANCE:.0%} of the simulator: {'PASS' if ok else 'FAIL'}")
    print(f"traces: {setting.trace_dir}/<schedule>/rank*.json (plait timeline DIR -o out.png)")
    return ok and mem_ok


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def parse_args(argv: list[str] | None = None) -> Setting:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks, 2-4 (default: 2)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--batch", type=int, default=64, help="global batch rows (default: 64)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches (default: 8)")
    parser.add_argument("--width", type=int, default=512, help="Linear width (default: 512)")
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks (default: 8)")
    parser.add_argument("--trace-dir", default=None, help="keep the traces here (default: a temp dir)")
    args = parser.parse_args(argv)
    if not 2 <= args.ranks <= 4:
        parser.error(f"--ranks {args.ranks}: use 2, 3 or 4")
    if args.layers * 2 < args.ranks * 2 or args.rounds < 2:
        parser.error(f"need --layers >= --ranks and --rounds >= 2, got {args.layers}, {args.rounds}")
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="plait-schedules-")
    return Setting(args.ranks, args.rounds, args.batch, args.microbatches, args.width, args.layers,
                   trace_dir)


def main(argv: list[str] | None = None) -> int:
    setting = parse_args(argv)
    result = run_job(_rank_main, setting.ranks, setting)
    return 0 if report(setting, json.loads(result)) else 1


if __name__ == "__main__":
    sys.exit(main())
