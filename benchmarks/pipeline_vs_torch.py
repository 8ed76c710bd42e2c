"""Step time of plait against torch.distributed.pipelining on the same model, split and schedule.

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each. Both pipelines train
their own copy of the same model (an nn.Sequential of `--layers` x (Linear(width, width), ReLU),
cut in the middle), on the same global batch cut into the same micro-batches, with the same
loss (mean-reduced MSE on the last stage) and the same optimizer: the SGD step (and clearing the
gradients) is inside the timed step for both. The peer is used the simplest fair way: the
Sequential split by hand into two `PipelineStage`s driven by `Schedule1F1B` / `ScheduleGPipe`.

Each round runs, for every schedule: the one-process reference steps (rank 0 alone, the other
rank waiting), plait's steps and the peer's, plait first on even rounds and the peer first on odd
ones. Each timing starts after a barrier and runs `--steps-per-round` steps back to back, as a
training loop runs them; a step's time is theirs over their number, on the slowest rank
(all_reduce MAX); CPU time is summed over the ranks. (One step per barrier timed the barrier's
wake-up too: a rank blocked in gloo's barrier can find its core halted and wait up to a scheduler
tick to run again, and in a pipeline the other rank waits for it, where one process does not.)
Medians over the rounds are reported against two targets:

    peer / plait                                              (target >= 1.4)
    ideal = T1 / p * (m + p - 1) / m                          (GPipe bubble, Huang et al. 2019)
    plait / ideal                                             (target <= 1.25)

where T1 is the median step (forward, backward, SGD step) of one process running the whole model
on the whole batch, p the number of stages and m the number of micro-batches. Tm is the same
process stepping through the m micro-batches one after another (gradients accumulated): the
arithmetic a pipeline does, without the pipeline. On a CPU a micro-batch of a few rows runs its
GEMMs far less efficiently than the whole batch, so Tm is well above T1, and ideal_m (the ideal
from Tm) is the bound a pipeline runtime can actually approach. "paired" is the median of the
per-round peer / plait ratios: on a shared machine it is steadier than the ratio of the medians.

Before timing, a correctness check trains fresh copies for a few steps with each schedule, at a
learning rate (CHECK_LR) that moves every weight tensor far past the tolerance (a copy that never
trained must fail it; the check asserts each moved), and compares every parameter of this
rank's stage with the one-process reference (fp32: rtol 1e-5, atol 1e-6).

With --planned, plait also runs as a user gets it by default: `Config()`, the layout (pp x dp,
micro-batches, schedule, batched weight gradients) chosen by its planner on the first step. Its
ideal is one process stepping through the same micro-batches (Tp: the global batch in chunks of
the plan's micro-batch rows), over the world, stretched by the plan's bubble:

    ideal_p = Tp / world * (m + (pp - 1) / v) / m      (world = pp x dp x tp; target plait / ideal_p <= 1.25)

The verdict is on the ratio of the medians; the median of each round's own ratio (plait's step
over the ideal_p of the Tp timed just before it) is printed beside it, as a check on drift.

    python benchmarks/pipeline_vs_torch.py [--rounds 40] [--schedules 1f1b,gpipe] [--batch 64]
                                           [--microbatches 8] [--width 512] [--layers 8] [--planned]
                                           [--steps-per-round 5]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import plait
from job import join_job, leave_job, mlp, regression_batch, run_job

from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

__all__ = ["main"]

NUM_STAGES = 2  # ranks, one pipeline stage each
LR = 1e-3  # small: over a run the weights, and so the work per step, barely change
# large: the check's 3 steps move every weight tensor well past the tolerance (the first of 8
# Linear+ReLU blocks at PyTorch's init gets ~1/400 of the last one's change: at lr 0.5 and width
# 512 it moved 2.7e-6, under 2x the tolerance; at 10, 3.7e-5), and the loss still falls
CHECK_LR = 10.0
MOVED = 20  # the check: each weight tensor's largest change from its init, at least MOVED x atol
SEED = 1234
WARMUP_STEPS = 5  # per pipeline and schedule, untimed (shape inference, first descriptions)
CHECK_STEPS = 3  # correctness check: steps from the same init
TARGET_RATIO = 1.4  # peer / plait, at least
TARGET_IDEAL = 1.25  # plait / ideal, at most
PEER_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


@dataclass(frozen=True)
class Setting:
    """One benchmark setting, the same on every rank."""

    rounds: int
    schedules: tuple[str, ...]
    batch: int
    microbatches: int
    width: int
    layers: int
    warmup: int
    batch_weight_grads: bool = False  # plait's Config(batch_weight_grads=...)
    planned: bool = False  # also time plait with Config(): the planner's own layout
    steps_per_round: int = 5  # steps timed back to back, after one barrier


# -- the model and the data ----------------------------------------------------------------------


def make_net(width: int, layers: int) -> nn.Sequential:
    """layers x (Linear(width, width), ReLU), identical on every rank (fixed seed)."""
    return mlp(width, layers, SEED)


def make_batch(setting: Setting, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (x, y) of `step`, identical on every rank."""
    return regression_batch(setting.batch, setting.width, SEED + 1 + step)


def stage_slice(setting: Setting, stage_index: int) -> slice:
    """The Sequential's children on `stage_index`: the blocks split evenly, Linear+ReLU kept together."""
    blocks = [setting.layers // NUM_STAGES + (1 if s < setting.layers % NUM_STAGES else 0)
              for s in range(NUM_STAGES)]
    start = 2 * sum(blocks[:stage_index])
    return slice(start, start + 2 * blocks[stage_index])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)  # mean over the micro-batch


# -- the three steps -----------------------------------------------------------------------------


class Runner(Protocol):
    def step(self, x: torch.Tensor, y: torch.Tensor) -> None: ...

    def stage_parameters(self) -> list[torch.Tensor]: ...


class PlaitRunner:
    """plait's public API as a user writes it (the optimizer gets all of net's parameters; those
    of the other stage never get a gradient, and SGD skips them)."""

    def __init__(self, net: nn.Sequential, setting: Setting, schedule: str, rank: int, lr: float = LR):
        self.net = net
        config = plait.Config(layers_per_stage=_layers_per_stage(setting),
                              num_microbatches=setting.microbatches, schedule=schedule,
                              batch_weight_grads=setting.batch_weight_grads)
        self.model = plait.Model(net, config=config,
                                 optimizer=torch.optim.SGD(net.parameters(), lr=lr), loss=loss_fn)
        self.local = stage_slice(setting, rank)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.train_on_batch(x, y)

    def stage_parameters(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.net[self.local].parameters()]


def _layers_per_stage(setting: Setting) -> tuple[int, ...]:
    # plait captures each Linear and each ReLU as one layer; cut where the peer is cut.
    return tuple(len(range(*stage_slice(setting, s).indices(2 * setting.layers)))
                 for s in range(NUM_STAGES))


class PlannedRunner:
    """plait as a user gets it by default: Config(), the layout planned on the first step."""

    def __init__(self, net: nn.Sequential, x: torch.Tensor, y: torch.Tensor, lr: float = LR):
        self.net = net
        self.model = plait.Model(net, config=plait.Config(),
                                 optimizer=torch.optim.SGD(net.parameters(), lr=lr), loss=loss_fn)
        self.model.train_on_batch(x, y)  # plans, then steps: the first of the steps compared

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.train_on_batch(x, y)

    def describe(self) -> str:
        plan = self.model.plan
        return (f"pp={plan.num_stages} dp={plan.dp} tp={plan.tp} m={plan.num_microbatches} {plan.schedule}"
                f"{f' v={plan.num_virtual_stages}' if plan.num_virtual_stages > 1 else ''}"
                f" recompute={list(plan.recompute)} batch_weight_grads={plan.batch_weight_grads}"
                f"{self._predicted()}")

    def _predicted(self) -> str:
        report = self.model.plan_report
        if report is None or report.predicted_step_s is None:
            return ""
        lines = [line for line in report.table.splitlines() if line[:2].strip().isdigit()][:5]
        return f"; predicted {report.predicted_step_s * 1e3:.2f} ms; the planner's table:\n" + "\n".join(lines)

    def chunks(self, batch: int) -> int:
        """The global batch in micro-batches of the plan's rows: what one process steps through."""
        plan = self.model.plan
        rows = -(-(-(-batch // plan.dp)) // plan.num_microbatches)
        return -(-batch // rows)

    def bubble(self, world: int) -> float:
        """1 / world, stretched by the plan's pipeline bubble."""
        plan = self.model.plan
        m, p, v = plan.num_microbatches, plan.num_stages, plan.num_virtual_stages
        return (m + (p - 1) / v) / m / world


class PeerRunner:
    """torch.distributed.pipelining: the Sequential cut by hand, one PipelineStage per rank."""

    def __init__(self, net: nn.Sequential, setting: Setting, schedule: str, rank: int, lr: float = LR):
        self.module = net[stage_slice(setting, rank)]  # shares the parameters of `net`
        self.rank = rank
        stage = PipelineStage(self.module, rank, NUM_STAGES, torch.device("cpu"))
        self.schedule = PEER_SCHEDULES[schedule](stage, setting.microbatches, loss_fn=loss_fn)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(x, return_outputs=False)
        elif self.rank == NUM_STAGES - 1:
            self.schedule.step(target=y, losses=[], return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        self.optimizer.step()

    def stage_parameters(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.module.parameters()]


class ReferenceRunner:
    """One process, the whole model: forward, backward, SGD step.

    With microbatches=1 the whole batch goes through at once (T1); with m > 1 it goes through
    as m micro-batches whose gradients accumulate (Tm): the same arithmetic as a pipeline's,
    with no pipeline.
    """

    def __init__(self, net: nn.Sequential, setting: Setting, rank: int, microbatches: int = 1, lr: float = LR):
        self.net = net
        self.optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        self.local = stage_slice(setting, rank)
        self.microbatches = microbatches

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.microbatches == 1:
            loss_fn(self.net(x), y).backward()
        else:
            for xs, ys in zip(x.chunk(self.microbatches), y.chunk(self.microbatches)):
                (loss_fn(self.net(xs), ys) / self.microbatches).backward()
        self.optimizer.step()

    def stage_parameters(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.net[self.local].parameters()]


# -- measuring -----------------------------------------------------------------------------------


Timing = tuple[float, float]  # (wall seconds of the slowest rank, CPU seconds summed over ranks)


def timed(step: Callable[[], None], only_rank: int | None = None, steps: int = 1) -> Timing:
    """Time `steps` steps back to back after a barrier, per step; with `only_rank` that rank runs
    them and the others wait."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()  # process time counts gloo's threads too
    if only_rank is None or dist.get_rank() == only_rank:
        for _ in range(steps):
            step()
    wall_t = torch.tensor([(time.perf_counter() - wall) / steps], dtype=torch.float64)
    cpu_t = torch.tensor([(time.process_time() - cpu) / steps], dtype=torch.float64)
    dist.all_reduce(wall_t, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu_t, op=dist.ReduceOp.SUM)
    return float(wall_t), float(cpu_t)


def least_moved(trained: list[torch.Tensor], init: list[torch.Tensor]) -> float:
    """The smallest, over the weight tensors, of each one's largest change from its init: a check
    whose tolerance is far below it cannot pass a copy that never trained."""
    return min(float((t - i).abs().max()) for t, i in zip(trained, init))


def check(setting: Setting, schedule: str, rank: int) -> bool:
    """After CHECK_STEPS steps at CHECK_LR from one init, do plait's and the peer's parameters of
    this rank's stage equal the one-process reference's, and did every one of them move by at least
    MOVED x atol? Printed on rank 0; every rank gets the verdict."""
    net = make_net(setting.width, setting.layers)
    ref = ReferenceRunner(copy.deepcopy(net), setting, rank, lr=CHECK_LR)
    init = [p.detach().clone() for p in ref.stage_parameters()]
    runners: list[Runner] = [PlaitRunner(copy.deepcopy(net), setting, schedule, rank, lr=CHECK_LR),
                             PeerRunner(copy.deepcopy(net), setting, schedule, rank, lr=CHECK_LR)]
    for step in range(CHECK_STEPS):
        x, y = make_batch(setting, step)
        ref.step(x, y)
        for runner in runners:
            runner.step(x, y)
    worst = torch.zeros(len(runners), dtype=torch.float64)
    passed = torch.ones(len(runners), dtype=torch.float64)
    for i, runner in enumerate(runners):
        for got, want in zip(runner.stage_parameters(), ref.stage_parameters()):
            worst[i] = max(float(worst[i]), float((got - want).abs().max()))
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                passed[i] = 0.0
    moved = torch.tensor([least_moved(ref.stage_parameters(), init)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(passed, op=dist.ReduceOp.MIN)
    dist.all_reduce(moved, op=dist.ReduceOp.MIN)
    trained = float(moved) >= MOVED * 1e-6
    if rank == 0:
        for name, w, ok in zip(("plait", "peer"), worst.tolist(), passed.tolist()):
            print(f"check {schedule:5s} {name:5s}: after {CHECK_STEPS} steps (lr {CHECK_LR}) max |param - "
                  f"one-process param| = {w:.1e}: {'ok' if ok else 'MISMATCH'} "
                  f"(rtol 1e-5, atol 1e-6); every weight tensor moved by at least {float(moved):.1e} "
                  f"({'ok' if trained else f'UNTRAINED: under {MOVED} x atol'})", flush=True)
    return bool(passed.min() > 0) and trained


def check_planned(setting: Setting, rank: int) -> tuple[str, bool]:
    """plait with Config() (its own plan) after CHECK_STEPS steps at CHECK_LR against one process
    through the same micro-batches: (the plan, its state_dict equal and every tensor moved)."""
    net = make_net(setting.width, setting.layers)
    reference = copy.deepcopy(net)
    x, y = make_batch(setting, 0)
    planned = PlannedRunner(net, x, y, lr=CHECK_LR)
    one = ReferenceRunner(reference, setting, rank, planned.chunks(setting.batch), lr=CHECK_LR)
    one.step(x, y)  # the planned run's first step, which planned it
    for step in range(1, CHECK_STEPS):
        xs, ys = make_batch(setting, step)
        planned.step(xs, ys)
        one.step(xs, ys)
    state, want, init = planned.model.state_dict(), reference.state_dict(), make_net(setting.width, setting.layers)
    worst = max(float((state[k] - want[k]).abs().max()) for k in want)
    equal = all(torch.allclose(state[k], want[k], rtol=1e-5, atol=1e-6) for k in want)
    moved = least_moved([want[k] for k in want], [init.state_dict()[k] for k in want])
    trained = moved >= MOVED * 1e-6
    if rank == 0:
        print(f"check planned: after {CHECK_STEPS} steps (lr {CHECK_LR}) max |param - one-process param| = "
              f"{worst:.1e}: {'ok' if equal else 'MISMATCH'} (rtol 1e-5, atol 1e-6); every tensor moved by at "
              f"least {moved:.1e} ({'ok' if trained else f'UNTRAINED: under {MOVED} x atol'})", flush=True)
    return planned.describe(), equal and trained


def measure_planned(setting: Setting, rank: int) -> tuple[str, float, bool, list[float], list[float]]:
    """plait with Config() against one process through its micro-batches: (the plan, the ideal's
    factor, parameters equal after CHECK_STEPS steps at CHECK_LR (`check_planned`, a copy planned
    on its own), plait's walls, the reference's walls)."""
    checked, equal = check_planned(setting, rank)
    net = make_net(setting.width, setting.layers)
    reference = copy.deepcopy(net)
    x, y = make_batch(setting, 0)
    planned = PlannedRunner(net, x, y)
    one = ReferenceRunner(reference, setting, rank, planned.chunks(setting.batch))
    one.step(x, y)  # the planned run's first step, which planned it
    layout = planned.describe().split(";")[0]
    if rank == 0 and checked.split(";")[0] != layout:
        print(f"(the check's copy was planned otherwise: {checked.split(';')[0]}; timed: {layout})", flush=True)
    for _ in range(setting.warmup):
        planned.step(x, y)
        one.step(x, y)
    mine: list[float] = []
    ones: list[float] = []
    for _ in range(setting.rounds):
        ones.append(timed(functools.partial(one.step, x, y), only_rank=0, steps=setting.steps_per_round)[0])
        mine.append(timed(functools.partial(planned.step, x, y), steps=setting.steps_per_round)[0])
    return planned.describe(), planned.bubble(dist.get_world_size()), equal, mine, ones


def report_planned(plan: str, bubble: float, equal: bool, mine: list[float], ones: list[float]) -> bool:
    """Print the planned row and its verdict."""
    t, tp = statistics.median(mine) * 1e3, statistics.median(ones) * 1e3
    ideal = tp * bubble
    ok = t / ideal <= TARGET_IDEAL and equal
    paired = statistics.median(m / (o * bubble) for m, o in zip(mine, ones))
    print(f"\nConfig() planned: {plan}\n  plait {t:.2f} ms (IQR {_iqr(mine):.1f}), one process through the "
          f"same micro-batches Tp {tp:.2f} ms (IQR {_iqr(ones):.1f}), ideal_p {ideal:.2f} ms, plait/ideal_p "
          f"{t / ideal:.2f} (paired: median of the rounds' own ratios {paired:.2f})")
    print(f"planned: {'PASS' if ok else 'FAIL'} (plait/ideal_p {t / ideal:.3f}, target <= {TARGET_IDEAL}; "
          f"parameters {'match' if equal else 'DO NOT match'})", flush=True)
    return ok


def measure(setting: Setting, rank: int) -> dict[str, dict[str, list[Timing]]]:
    """Per schedule, the step timings of "plait", "peer", "T1" and "Tm" (one process, rank 0)."""
    net = make_net(setting.width, setting.layers)
    references = {"T1": ReferenceRunner(copy.deepcopy(net), setting, rank),
                  "Tm": ReferenceRunner(copy.deepcopy(net), setting, rank, setting.microbatches)}
    runners: dict[str, dict[str, Runner]] = {
        schedule: {"plait": PlaitRunner(copy.deepcopy(net), setting, schedule, rank),
                   "peer": PeerRunner(copy.deepcopy(net), setting, schedule, rank)}
        for schedule in setting.schedules
    }
    x, y = make_batch(setting, 0)
    for _ in range(setting.warmup):
        for ref in references.values():
            ref.step(x, y)
        for pair in runners.values():
            for runner in pair.values():
                runner.step(x, y)
    times: dict[str, dict[str, list[Timing]]] = {
        s: {name: [] for name in ("plait", "peer", *references)} for s in setting.schedules
    }
    for r in range(setting.rounds):
        for schedule, pair in runners.items():
            for name, ref in references.items():
                times[schedule][name].append(timed(functools.partial(ref.step, x, y), only_rank=0,
                                                   steps=setting.steps_per_round))
            for name in (["plait", "peer"] if r % 2 == 0 else ["peer", "plait"]):
                times[schedule][name].append(timed(functools.partial(pair[name].step, x, y),
                                                   steps=setting.steps_per_round))
    return times


def report(setting: Setting, times: dict[str, dict[str, list[Timing]]], correct: bool) -> bool:
    """Print the table and the verdicts; True if every schedule meets both targets."""
    m, p = setting.microbatches, NUM_STAGES
    bubble = (m + p - 1) / (p * m)  # a stage's share of the work, stretched by the bubble
    print(f"\n{setting.layers} x (Linear({setting.width}, {setting.width}) + ReLU), batch "
          f"{setting.batch} in {m} micro-batches, {p} stages x 1 thread, SGD step included, "
          f"medians of {setting.rounds} rounds of {setting.steps_per_round} steps, ms a step (slowest rank)")
    columns = ["schedule", "plait", "peer", "peer/plait", "paired", "T1", "ideal", "plait/ideal",
               "Tm", "ideal_m", "plait/ideal_m"]
    print(" ".join(f"{c:>13s}" if i else f"{c:9s}" for i, c in enumerate(columns)))
    verdicts = []
    for schedule in setting.schedules:
        t = {k: statistics.median(w for w, _ in v) * 1e3 for k, v in times[schedule].items()}
        ideal, ideal_m = t["T1"] * bubble, t["Tm"] * bubble
        ratio, over = t["peer"] / t["plait"], t["plait"] / ideal
        # the same ratio round by round: the two steps of a round ran seconds apart
        paired = statistics.median(
            peer[0] / mine[0] for peer, mine in zip(times[schedule]["peer"], times[schedule]["plait"])
        )
        row = [t["plait"], t["peer"], ratio, paired, t["T1"], ideal, over, t["Tm"], ideal_m,
               t["plait"] / ideal_m]
        print(f"{schedule:9s} " + " ".join(f"{v:13.2f}" for v in row))
        verdicts.append((schedule, ratio >= TARGET_RATIO and over <= TARGET_IDEAL and correct,
                         ratio, over))
    print("CPU ms per step, summed over ranks (medians): " + "; ".join(
        f"{s} " + ", ".join(f"{k} {statistics.median(c for _, c in v) * 1e3:.1f}"
                            for k, v in times[s].items())
        for s in setting.schedules))
    print("spread of the walls (ms, interquartile range): " + "; ".join(
        f"{s} " + ", ".join(f"{k} {_iqr([w for w, _ in v]):.1f}" for k, v in times[s].items())
        for s in setting.schedules))
    print("peer/plait: ratio of the medians; paired: median of the per-round ratios. "
          "ideal = T1 / p * (m + p - 1) / m;\nideal_m: the same from Tm, one process stepping "
          "through the m micro-batches (the arithmetic a pipeline does)")
    for schedule, ok, ratio, over in verdicts:
        print(f"{schedule}: {'PASS' if ok else 'FAIL'} (peer/plait {ratio:.2f}, target >= "
              f"{TARGET_RATIO}; plait/ideal {over:.2f}, target <= {TARGET_IDEAL}; parameters "
              f"{'match' if correct else 'DO NOT match'})", flush=True)
    return all(ok for _, ok, _, _ in verdicts)


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) * 1e3


# -- the job -------------------------------------------------------------------------------------


def _rank_main(rank: int, port: int, setting: Setting, result_path: str) -> None:
    join_job(rank, NUM_STAGES, port)
    try:
        correct = all([check(setting, s, rank) for s in setting.schedules])
        times = measure(setting, rank)
        planned = measure_planned(setting, rank) if setting.planned else None
        if rank == 0:
            passed = report(setting, times, correct)
            if planned is not None:
                passed = report_planned(*planned) and passed
            Path(result_path).write_text("pass" if passed else "fail")
    finally:
        leave_job()


def parse_args(argv: list[str] | None = None) -> Setting:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds (default: 40)")
    parser.add_argument("--schedules", default="1f1b,gpipe",
                        help="comma-separated, of 1f1b, gpipe (default: 1f1b,gpipe)")
    parser.add_argument("--batch", type=int, default=64, help="global batch rows (default: 64)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches (default: 8)")
    parser.add_argument("--width", type=int, default=512, help="Linear width (default: 512)")
    parser.add_argument("--batch-weight-grads", action="store_true",
                        help="plait computes linear weight gradients once per step over all micro-batches")
    parser.add_argument("--planned", action="store_true",
                        help="also time plait with Config(): the layout its planner chooses")
    parser.add_argument("--layers", type=int, default=8,
                        help="Linear+ReLU blocks, split evenly over the 2 stages (default: 8)")
    parser.add_argument("--steps-per-round", type=int, default=5,
                        help="steps timed back to back after each barrier (default: 5)")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS,
                        help=f"untimed steps per pipeline first (default: {WARMUP_STEPS})")
    args = parser.parse_args(argv)
    schedules = tuple(s.strip().lower() for s in args.schedules.split(",") if s.strip())
    unknown = [s for s in schedules if s not in PEER_SCHEDULES]
    if unknown or not schedules:
        parser.error(f"--schedules {args.schedules!r}: unknown {unknown}; choose from "
                     f"{', '.join(PEER_SCHEDULES)}")
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} is not a multiple of --microbatches "
                     f"{args.microbatches}; the peer needs equal micro-batches")
    if args.layers < NUM_STAGES or args.rounds < 2 or args.steps_per_round < 1:
        parser.error(f"need --layers >= {NUM_STAGES}, --rounds >= 2 and --steps-per-round >= 1, got "
                     f"{args.layers}, {args.rounds}, {args.steps_per_round}")
    return Setting(args.rounds, schedules, args.batch, args.microbatches, args.width,
                   args.layers, args.warmup, args.batch_weight_grads, args.planned, args.steps_per_round)


def main(argv: list[str] | None = None) -> int:
    setting = parse_args(argv)
    return 0 if run_job(_rank_main, NUM_STAGES, setting) == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
