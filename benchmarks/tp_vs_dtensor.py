"""Step time of plait's tensor parallelism (tp = 2) against torch's own `parallelize_module`.

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each. The model is an MLP of
4 x (Linear 1024 -> 4096, GELU, Linear 4096 -> 1024), a batch of 16 rows, MSE loss, SGD:

    plait   plait.Model(net, Config(tp=2)): the first Linear of each pair column-parallel, the
            second row-parallel, found on the captured graph; train_on_batch
    dtensor torch.distributed.tensor.parallel.parallelize_module(net, mesh, {"i.0": ColwiseParallel(),
            "i.2": RowwiseParallel()}) on a 1-D CPU mesh; forward, loss, backward, SGD step
    one     the same step in one process, one thread (rank 0, while rank 1 waits)

Both are first checked equal to one process (the loss and every parameter after 3 steps at a
learning rate, CHECK_LR, that moves every weight tensor at least MOVED x atol from its init, which
the check asserts: a copy that never trained fails it; fp32 atol 2e-5, fresh copies). Then each round times plait and dtensor (alternating which goes first), each step
after a barrier and taken as the slowest rank's; medians over the rounds, and the target:

    plait / dtensor <= 1.0

    python benchmarks/tp_vs_dtensor.py [--rounds 30] [--batch 16] [--width 1024]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plait

from job import timed  # noqa: E402 - benchmarks/ is the script's own directory on sys.path


def build(width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(4)])


LR = 1e-2  # the timed steps
# the check's: 3 steps at 1e-2 move the first Linear's bias 5e-8 (width 1024), far under the
# tolerance; at CHECK_LR every tensor moves >= 1.6e-3 (79x atol) and the loss still falls
# (1.010, 0.975, 0.945; a 4th step would overshoot)
CHECK_LR = 100.0
MOVED = 20  # the check: each tensor's largest change from its init, at least MOVED x atol
ATOL = 2e-5


def sgd(params: Any, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


def dtensor_model(net: nn.Module, lr: float = LR) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan: dict[str, Any] = {}
    for i in range(4):
        plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    net = parallelize_module(net, mesh, plan)
    return net, sgd(net.parameters(), lr)


def dtensor_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(net(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def whole(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, world: int, rank: int, out: Any) -> None:
    """3 steps at CHECK_LR of fresh copies: plait's and dtensor's loss and state equal one process's,
    and every tensor moved at least MOVED x ATOL; else SystemExit naming what differs."""
    init = build(args.width)
    ref = build(args.width)
    ref_opt = sgd(ref.parameters(), CHECK_LR)
    model = plait.Model(build(args.width), plait.Config(tp=world, num_microbatches=1),
                        optimizer=lambda params: sgd(params, CHECK_LR), loss=nn.functional.mse_loss)
    dnet, dopt = dtensor_model(build(args.width), CHECK_LR)
    problems = []
    for _ in range(3):
        want = dtensor_step(ref, ref_opt, x, y)
        got_plait, got_dtensor = model.train_on_batch(x, y), dtensor_step(dnet, dopt, x, y)
        for name, got in (("plait", got_plait), ("dtensor", got_dtensor)):
            if abs(got - want) > 1e-5 * abs(want) + 1e-6:
                problems.append(f"{name} loss {got} != {want}")
    state, dstate, worst = model.state_dict(), dnet.state_dict(), 0.0
    for key, value in ref.state_dict().items():
        for name, got in (("plait", state[key]), ("dtensor", whole(dstate[key]))):
            worst = max(worst, float((got - value).abs().max()))
            if not torch.allclose(got, value, rtol=1e-5, atol=ATOL):
                problems.append(f"{name} {key} differs by {float((got - value).abs().max()):.2e}")
    moved = min(float((value - init.state_dict()[key]).abs().max()) for key, value in ref.state_dict().items())
    if moved < MOVED * ATOL:
        problems.append(f"a tensor moved only {moved:.1e} from its init in 3 steps at lr {CHECK_LR}, under "
                        f"{MOVED} x atol {ATOL}: the check would pass a copy that never trained")
    if problems:
        raise SystemExit("not equal to one process: " + "; ".join(problems))
    if rank == 0:
        out.put((worst, moved))


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)

    # -- equal to one process first ---------------------------------------------------------------
    check(args, x, y, world, rank, out)
    ref = build(args.width)
    ref_opt = sgd(ref.parameters())
    model = plait.Model(build(args.width), plait.Config(tp=world, num_microbatches=1), optimizer=sgd,
                        loss=nn.functional.mse_loss)
    dnet, dopt = dtensor_model(build(args.width))

    # -- timing -----------------------------------------------------------------------------------
    plait_s, dtensor_s, one_s = [], [], []
    for r in range(args.warmup + args.rounds):
        pair = [("plait", lambda: model.train_on_batch(x, y)), ("dtensor", lambda: dtensor_step(dnet, dopt, x, y))]
        times = {name: timed(step) for name, step in (pair if r % 2 == 0 else pair[::-1])}
        one = timed(lambda: dtensor_step(ref, ref_opt, x, y) if rank == 0 else None)
        if r >= args.warmup:
            plait_s.append(times["plait"])
            dtensor_s.append(times["dtensor"])
            one_s.append(one)
    if rank == 0:
        out.put((statistics.median(plait_s), statistics.median(dtensor_s), statistics.median(one_s)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(rank_main, args=(2, port, args, out), nprocs=2, start_method="spawn")
    worst, moved = out.get(timeout=5)
    plait_s, dtensor_s, one_s = out.get(timeout=5)
    print(f"MLP 4 x (Linear {args.width}->{4 * args.width}, GELU, Linear), batch {args.batch}, 2 gloo ranks x 1 thread, "
          f"{args.rounds} rounds (medians)")
    print(f"both equal to one process (loss and parameters after 3 SGD steps at lr {CHECK_LR}: max |difference| "
          f"{worst:.1e}, atol {ATOL}; every tensor moved by at least {moved:.1e}, {moved / ATOL:.0f} x atol)")
    print(f"  plait   tp=2                 {plait_s * 1e3:8.2f} ms")
    print(f"  torch   parallelize_module   {dtensor_s * 1e3:8.2f} ms")
    print(f"  one process, one thread      {one_s * 1e3:8.2f} ms")
    ratio = plait_s / dtensor_s
    print(f"plait / parallelize_module = {ratio:.3f}  (target <= 1.0: {'PASS' if ratio <= 1.0 else 'FAIL'})")
    print(f"plait tp=2 / one process   = {plait_s / one_s:.3f}")


if __name__ == "__main__":
    main()
