"""Measured step time and activation memory of plait's schedules against what the planner predicts.

One job, spawned here: `--ranks` gloo ranks on 127.0.0.1, one CPU thread each, one pipeline
(stage s on rank s). The model is `--layers` x (Linear(width, width), ReLU), the loss a mean MSE,
the optimizer SGD. Every schedule trains its own copy with `Config(trace_dir=...)`; rounds run
the schedules one after another (the order rotated each round), every step after a barrier, its
time the slowest rank's.

Prediction, as the planner makes it and before anything is timed: after the warm-up steps (in
which each model plans its layers), every rank at once measures the link
(`plait.planner.calibrate.calibrate`) and profiles the model once (`profile_sample`, each round
the slowest rank's whole-model times, as planning profiles); then each schedule's layout (its
plan's layers per stage) is priced by the planner's cost model, `plait.cost.prediction.predict` with
the schedule simulated on the generator's own program. The timed runs' traces are written for
`plait timeline` only: no prediction reads them. The check is on ratios between schedules:
(measured s / measured 1F1B) / (predicted s / predicted 1F1B) must be within 1 +- 0.15; the
absolute predicted / measured of each schedule is printed beside it.

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
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import plait
from job import join_job, leave_job, mlp, regression_batch, run_job
from plait.cost import prediction as cost
from plait.planner.autoplan import PlanOptions, local_cluster, profile_sample
from plait.planner.calibrate import calibrate
from plait.runtime.comm.collectives import max_floats

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
        predicted = predictions(setting, models)
        walls: dict[str, list[float]] = defaultdict(list)
        names = list(models)
        for r in range(setting.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                walls[name].append(timed_step(models[name], *make_batch(setting, r)))
        for model in models.values():
            model.write_trace()
        gathered: list[Any] = [None] * setting.ranks
        dist.all_gather_object(gathered, peaks)
        if rank == 0:
            Path(result_path).write_text(json.dumps({"walls": walls, "peaks": gathered, **predicted}))
    finally:
        leave_job()


def predictions(setting: Setting, models: dict[str, plait.Model]) -> dict[str, Any]:
    """Every rank at once: the link and one profile of the model, then each schedule's layout
    priced by the planner's cost model. JSON-ready: {"predicted": {name: priced layout}, "link"}."""
    network = calibrate()
    x, y = make_batch(setting, 0)
    options = PlanOptions(optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss=nn.functional.mse_loss,
                          target=y, reuse_profile=False, threads=1, slowest=max_floats)
    costs = profile_sample(make_net(setting), x, setting.ranks, options).costs
    cluster = local_cluster(setting.ranks, network=network, optimizer_state_factor=0.0)  # plain SGD
    predicted = {}
    for name, model in models.items():
        plan = model.plan
        layout = cost.Setting(plan.pp, plan.dp, plan.num_microbatches, plan.schedule,
                              plan.num_virtual_stages, bool(plan.recompute))
        priced = cost.predict(costs, layout, cluster, setting.batch, plan.layers_per_stage, simulate=True)
        predicted[name] = {
            "layers": list(plan.layers_per_stage), "recompute": list(plan.recompute),
            "step_s": priced.step_time_s, "pipeline_s": priced.pipeline_s,
            "optimizer_s": max(priced.optimizer_s), "closing_s": priced.closing_s,
            "stages": [[st.forward_s, st.backward_s, st.weight_s, st.send_s] for st in priced.stages],
        }
    link = network.link([0, 1])
    return {"predicted": predicted, "link": [link.latency_s, link.bandwidth]}


def report(setting: Setting, result: dict[str, Any]) -> bool:
    p, m = setting.ranks, setting.microbatches
    measured = {name: statistics.median(w) * 1e3 for name, w in result["walls"].items()}
    priced = result["predicted"]
    predicted = {name: priced[name]["step_s"] * 1e3 for name in SCHEDULES}
    print(f"\n{setting.layers} x (Linear({setting.width}) + ReLU), batch {setting.batch} in {m} "
          f"micro-batches, {p} ranks x 1 thread; measured: medians of {setting.rounds} rounds; "
          "predicted: the planner's cost model on a profile taken before them; ms")
    print(f"{'schedule':12s} {'measured':>9s} {'predicted':>9s} {'pred/meas':>9s} {'meas/1f1b':>9s} "
          f"{'pred/1f1b':>9s} {'agreement':>9s}")
    ok = True
    for name in SCHEDULES:
        mr, pr = measured[name] / measured["1f1b"], predicted[name] / predicted["1f1b"]
        agree = mr / pr
        ok &= abs(agree - 1) <= TOLERANCE
        print(f"{name:12s} {measured[name]:9.2f} {predicted[name]:9.2f} {predicted[name] / measured[name]:9.3f} "
              f"{mr:9.3f} {pr:9.3f} {agree:9.3f}")
    latency, bandwidth = result["link"]
    print(f"priced per stage, ms (one micro-batch; B holds W except in zbh1; send: the hand-over on a "
          f"link of {latency * 1e6:.0f} us + bytes / {bandwidth / 1e9:.2f} GB/s), the pipeline and the optimizer")
    for name in SCHEDULES:
        layout = priced[name]
        f, b, w, send = zip(*layout["stages"])
        recompute = f"  recompute {layout['recompute']}" if layout["recompute"] else ""
        print(f"{name:12s} layers {layout['layers']}  F {_fmt(f)}  B {_fmt(b)}  W {_fmt(w)}  "
              f"send {_fmt(send[:-1])}  pipeline {layout['pipeline_s'] * 1e3:.2f}  "
              f"opt {layout['optimizer_s'] * 1e3:.2f}{recompute}")
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


def _fmt(seconds: Sequence[float]) -> str:
    return "[" + ", ".join(f"{1e3 * v:.2f}" for v in seconds) + "]"


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
