"""Step time of plait's data parallelism (1 stage, dp = 2) against DistributedDataParallel on gloo.

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each. Both train their own copy
of the same model on the same global batch with the same loss and optimizer; the SGD step (and
clearing the gradients) is inside the timed step for both:

    plait  plait.Model(net, Config(num_stages=1, dp=2, num_microbatches=1)), train_on_batch on
           the global batch: plait shards it (rows [0, B/2) on rank 0, [B/2, B) on rank 1),
           all-reduces the gradients in buckets during the backward pass, returns the global loss
    ddp    DistributedDataParallel(net) (its default buckets), each rank given its half of the batch
    local  the same forward, backward and SGD step on each rank's half, with no communication
           at all: the floor both approach (not a data-parallel step; shown for scale)

With --zero the optimizer is Adam (eps 1e-3) and its state is sharded over the two replicas on
both sides: plait's `Config(zero=1)` against DDP with torch's `ZeroRedundancyOptimizer` (each
rank steps its share of the parameters, then the updated parameters are broadcast); `local`
steps Adam unsharded.

Each round runs the three steps, plait before DDP on even rounds and after it on odd ones. Every
timed step starts after a barrier, and its time is the slowest rank's (all_reduce MAX). Medians
over the rounds, and the target:

    plait / ddp <= 1.05

"paired" is the median of the per-round plait / ddp ratios (steadier on a shared machine).

Before timing, a correctness check trains fresh copies from one init for a few steps on the same
data and compares plait's `model.state_dict()` with DDP's `module.state_dict()`
(fp32: rtol 1e-5, atol 1e-6). With --profile DIR, each rank then runs plait steps under cProfile,
writes DIR/plait_rank{r}.prof and rank 0 prints the heaviest functions.

    python benchmarks/dp_vs_ddp.py [--model mlp|cnn] [--rounds 60] [--batch 64] [--zero] [--profile DIR]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import functools
import io
import math
import os
import pstats
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import plait
from job import join_job, leave_job, mlp, run_job, timed
from plait.cli.demo import PaperCNN

__all__ = ["main"]

WORLD_SIZE = 2  # ranks = data-parallel replicas, one stage each
LR = 1e-3  # small: over a run the weights, and so the work per step, barely change
# large: the check's 3 steps move every weight tensor well past the tolerance (at least MOVED x
# atol). SGD on the MLP needs 10: its first of 8 blocks gets ~1/400 of the last one's change, 2.1e-6
# at 0.5, under 2x the tolerance; the CNN moves >= 4.2e-3 at 0.5 and diverges at 2 (loss 2.3 -> 6.0);
# Adam moves every entry ~lr a step.
CHECK_LR = {"mlp": 10.0, "cnn": 0.5, "adam": 0.5}
MOVED = 20
SEED = 1234
WARMUP_STEPS = 5  # per runner, untimed (capture, DDP's bucket rebuild after its first step)
CHECK_STEPS = 3  # correctness check: steps from the same init
PROFILE_STEPS = 50
TARGET_RATIO = 1.05  # plait / ddp, at most
ADAM_EPS = 1e-3
MODELS = ("mlp", "cnn")


@dataclass(frozen=True)
class Setting:
    """One benchmark setting, the same on every rank."""

    model: str
    rounds: int
    batch: int
    width: int
    layers: int
    warmup: int
    profile: str | None
    bucket_mb: float | None  # plait's Config.bucket_cap_mb (None: plait's default)
    zero: bool = False  # Adam with its state sharded: plait zero=1 against ZeroRedundancyOptimizer


# -- the model and the data ----------------------------------------------------------------------


def make_net(setting: Setting) -> nn.Module:
    """The model, identical on every rank (fixed seed).

    mlp: layers x (Linear(width, width), ReLU): 8 x 512 is 2.1M parameters, an 8.4 MB gradient
    all-reduced every step against ~5-10 ms of compute, so the all-reduce matters.
    cnn: the paper's MNIST CNN, 1.2M parameters, most of them in one Linear(9216, 128), with its
    Dropouts made Identity: each runner would draw its own masks, and the states could not match.
    """
    torch.manual_seed(SEED)
    if setting.model == "cnn":
        net = PaperCNN(28)
        for i, layer in enumerate(net):
            if isinstance(layer, nn.Dropout):
                net[i] = nn.Identity()
        return net
    return mlp(setting.width, setting.layers, SEED)


def make_batch(setting: Setting, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (x, y) of `step`, identical on every rank."""
    g = torch.Generator().manual_seed(SEED + 1 + step)
    if setting.model == "cnn":
        x = torch.rand(setting.batch, 1, 28, 28, generator=g)  # (B, 1, 28, 28)
        y = torch.randint(0, 10, (setting.batch,), generator=g)  # (B,)
    else:
        x = torch.randn(setting.batch, setting.width, generator=g)  # (B, width)
        y = torch.randn(setting.batch, setting.width, generator=g)  # (B, width)
    return x, y


def make_loss(setting: Setting) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    # both mean over the batch, as plait requires
    return nn.CrossEntropyLoss() if setting.model == "cnn" else nn.MSELoss()


def make_optimizer(setting: Setting, params: Any, lr: float) -> torch.optim.Optimizer:
    """SGD, or with --zero Adam (eps 1e-3: equal results despite summation order, as the tests)."""
    return torch.optim.Adam(params, lr=lr, eps=ADAM_EPS) if setting.zero else torch.optim.SGD(params, lr=lr)


def local_rows(setting: Setting, rank: int) -> slice:
    """This rank's half of the global batch: the rows plait gives replica `rank`."""
    half = setting.batch // WORLD_SIZE
    return slice(rank * half, (rank + 1) * half)


# -- the three steps -----------------------------------------------------------------------------


class PlaitRunner:
    """plait's public API as a user writes it: the global batch in, plait shards it."""

    def __init__(self, net: nn.Module, setting: Setting, rank: int, lr: float = LR):
        config = plait.Config(num_stages=1, dp=WORLD_SIZE, num_microbatches=1, zero=int(setting.zero))
        if setting.bucket_mb is not None:
            config = dataclasses.replace(config, bucket_cap_mb=setting.bucket_mb)
        self.model = plait.Model(net, config=config,
                                 optimizer=lambda params: make_optimizer(setting, params, lr),
                                 loss=make_loss(setting))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model.train_on_batch(x, y)

    def state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


class DDPRunner:
    """torch's DistributedDataParallel with its defaults; each rank is given its own half."""

    def __init__(self, net: nn.Module, setting: Setting, rank: int, communicate: bool = True,
                 lr: float = LR):
        self.module = DistributedDataParallel(net) if communicate else net
        self.optimizer: torch.optim.Optimizer = make_optimizer(setting, self.module.parameters(), lr)
        if setting.zero and communicate:
            self.optimizer = ZeroRedundancyOptimizer(self.module.parameters(), optimizer_class=torch.optim.Adam,
                                                     lr=lr, eps=ADAM_EPS)
        self.loss = make_loss(setting)
        self.rows = local_rows(setting, rank)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.module(x[self.rows]), y[self.rows]).backward()
        self.optimizer.step()

    def state(self) -> dict[str, torch.Tensor]:
        module = self.module.module if isinstance(self.module, DistributedDataParallel) else self.module
        return module.state_dict()


# -- measuring -----------------------------------------------------------------------------------


def check(setting: Setting, rank: int) -> bool:
    """After CHECK_STEPS steps from one init on the same data, does plait's state_dict equal
    DDP's module state, and did every tensor move at least MOVED x atol? Printed on rank 0; every
    rank gets the verdict."""
    net = make_net(setting)
    lr = CHECK_LR["adam" if setting.zero else setting.model]
    mine = PlaitRunner(copy.deepcopy(net), setting, rank, lr=lr)
    theirs = DDPRunner(copy.deepcopy(net), setting, rank, lr=lr)
    for step in range(CHECK_STEPS):
        x, y = make_batch(setting, step)
        mine.step(x, y)
        theirs.step(x, y)
    got, want = mine.state(), theirs.state()
    worst, passed, moved, least = 0.0, got.keys() == want.keys(), 0.0, math.inf
    for name, w in want.items():
        worst = max(worst, float((got[name] - w).abs().max()))
        change = float((w - net.state_dict()[name]).abs().max())
        moved, least = max(moved, change), min(least, change)
        passed = passed and torch.allclose(got[name], w, rtol=1e-5, atol=1e-6)
    trained = least >= MOVED * 1e-6
    verdict = torch.tensor([worst, 1.0 if passed and trained else 0.0], dtype=torch.float64)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # passed only if on every rank
    if rank == 0:
        print(f"check: after {CHECK_STEPS} {'Adam' if setting.zero else 'SGD'} steps (lr {lr}) from one init, {len(want)} "
              f"tensors: max |plait state_dict - DDP module state| = {worst:.1e} (largest change from init "
              f"{moved:.1e}; every tensor's at least {least:.1e}, {'ok' if trained else f'UNTRAINED: under {MOVED} x atol'}): "
              f"{'ok' if passed else 'MISMATCH'} (rtol 1e-5, atol 1e-6)", flush=True)
    return bool(verdict[1] > 0)


def measure(setting: Setting, rank: int) -> dict[str, list[float]]:
    """Step times of "plait", "ddp" and "local", round by round."""
    net = make_net(setting)
    runners: dict[str, PlaitRunner | DDPRunner] = {"plait": PlaitRunner(copy.deepcopy(net), setting, rank),
               "ddp": DDPRunner(copy.deepcopy(net), setting, rank),
               "local": DDPRunner(copy.deepcopy(net), setting, rank, communicate=False)}
    x, y = make_batch(setting, 0)
    for _ in range(setting.warmup):
        for runner in runners.values():
            runner.step(x, y)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(setting.rounds):
        for name in (["plait", "ddp", "local"] if r % 2 == 0 else ["ddp", "plait", "local"]):
            times[name].append(timed(functools.partial(runners[name].step, x, y)))
    return times


def profile(setting: Setting, rank: int, folder: Path) -> None:
    """PROFILE_STEPS plait steps under cProfile on every rank; rank 0 prints its heaviest functions."""
    runner = PlaitRunner(make_net(setting), setting, rank)
    x, y = make_batch(setting, 0)
    for _ in range(setting.warmup):
        runner.step(x, y)
    dist.barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILE_STEPS):
        runner.step(x, y)
    profiler.disable()
    folder.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(folder / f"plait_rank{rank}.prof"))
    if rank == 0:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(20)
        print(f"\ncProfile of {PROFILE_STEPS} plait steps on rank 0 (per-rank files in {folder}/), "
              f"by own time:\n{text.getvalue()}", flush=True)


def report(setting: Setting, times: dict[str, list[float]], correct: bool) -> bool:
    """Print the table and the verdict; True if plait meets the target and the states match."""
    ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    iqr = {name: _iqr(v) * 1e3 for name, v in times.items()}
    ratio = ms["plait"] / ms["ddp"]
    paired = statistics.median(p / d for p, d in zip(times["plait"], times["ddp"]))
    what = (f"{setting.layers} x (Linear({setting.width}, {setting.width}) + ReLU)"
            if setting.model == "mlp" else "PaperCNN(28)")
    params = sum(p.numel() for p in make_net(setting).parameters())
    print(f"\n{what}, {params / 1e6:.2f}M parameters, global batch {setting.batch} "
          f"({setting.batch // WORLD_SIZE} per rank), {WORLD_SIZE} gloo ranks x 1 thread, "
          f"{'Adam step, state sharded (plait zero=1 / ZeroRedundancyOptimizer)' if setting.zero else 'SGD step'} "
          f"included; medians of {setting.rounds} rounds, ms (slowest rank)")
    print(f"{'':8s}{'plait':>10s}{'ddp':>10s}{'local':>10s}{'plait/ddp':>11s}{'paired':>9s}")
    print(f"{'median':8s}{ms['plait']:10.2f}{ms['ddp']:10.2f}{ms['local']:10.2f}{ratio:11.3f}{paired:9.3f}")
    print(f"{'IQR':8s}{iqr['plait']:10.2f}{iqr['ddp']:10.2f}{iqr['local']:10.2f}")
    ok = ratio <= TARGET_RATIO and correct
    print(f"{'PASS' if ok else 'FAIL'}: plait/ddp {ratio:.3f} (paired {paired:.3f}), target <= "
          f"{TARGET_RATIO}; states {'match' if correct else 'DO NOT match'}; 1-minute load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    return ok


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


# -- the job -------------------------------------------------------------------------------------


def _rank_main(rank: int, port: int, setting: Setting, result_path: str) -> None:
    join_job(rank, WORLD_SIZE, port)
    try:
        correct = check(setting, rank)
        times = measure(setting, rank)
        if rank == 0:
            passed = report(setting, times, correct)
            Path(result_path).write_text("pass" if passed else "fail")
        if setting.profile:
            profile(setting, rank, Path(setting.profile))
    finally:
        leave_job()


def parse_args(argv: list[str] | None = None) -> Setting:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="mlp",
                        help="mlp: --layers x Linear(--width) + ReLU; cnn: the paper's MNIST CNN "
                             "(default: mlp)")
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds (default: 60)")
    parser.add_argument("--batch", type=int, default=64, help="global batch rows (default: 64)")
    parser.add_argument("--width", type=int, default=512, help="mlp: Linear width (default: 512)")
    parser.add_argument("--layers", type=int, default=8, help="mlp: Linear+ReLU blocks (default: 8)")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS,
                        help=f"untimed steps per runner first (default: {WARMUP_STEPS})")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="plait's Config.bucket_cap_mb (default: plait's own default); DDP keeps its "
                             "defaults")
    parser.add_argument("--zero", action="store_true",
                        help="Adam with sharded state: plait zero=1 against DDP + ZeroRedundancyOptimizer")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help=f"after timing, profile {PROFILE_STEPS} plait steps per rank with cProfile "
                             "into DIR/plait_rank{r}.prof")
    args = parser.parse_args(argv)
    if args.batch < WORLD_SIZE or args.batch % WORLD_SIZE:
        parser.error(f"--batch {args.batch} must be a positive multiple of {WORLD_SIZE}: DDP gives "
                     "each rank an equal half")
    if args.rounds < 2 or args.layers < 1 or args.width < 1:
        parser.error(f"need --rounds >= 2, --layers >= 1, --width >= 1, got {args.rounds}, "
                     f"{args.layers}, {args.width}")
    return Setting(args.model, args.rounds, args.batch, args.width, args.layers, args.warmup,
                   args.profile, args.bucket_mb, args.zero)


def main(argv: list[str] | None = None) -> int:
    setting = parse_args(argv)
    return 0 if run_job(_rank_main, WORLD_SIZE, setting) == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
