"""Step time of compiled stages against eager ones (Config(compile=...)) on a GPT-2.

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each, a 2-stage pipeline
(`Config(num_stages=2, num_microbatches=--microbatches)`, 1F1B). The model: Hugging Face GPT-2
(`--layers` x `--width`, 4 heads, vocabulary 1024, no dropout), batch `--rows` x `--seq` tokens, SGD:

    eager     Config(): each stage's captured graph run by the fx interpreter's Python code
    compiled  Config(compile=--backend): each stage's graph (forward and backward) through
              torch.compile, by default inductor (C++ kernels for this CPU)

Both start from one init and train the same 3 steps first: their losses must agree to 1e-5
(relative) and every parameter after them to rtol 1e-5 / atol 2e-5 (fp32 rounding: inductor fuses
and reorders), else the benchmark stops. Compiling: the compiled model's first step less the eager
model's (both capture and cut the model there; inductor's on-disk cache may hold kernels of an
earlier run). Then the step time: medians over alternating rounds, each the slowest rank's.
Printed: both sides and compiled / eager (no target here: the issue asks it measured).

    python benchmarks/compile.py [--backend inductor] [--rounds 10] [--layers 4] [--width 256] [--seq 128] [--rows 8]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plait

from job import (VOCAB, alternating_medians, gpt2_parser, join_job, leave_job, next_token_loss,  # noqa: E402
                 run_job, small_gpt2)  # benchmarks/ is the script's own directory on sys.path


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)


def rank_main(rank: int, port: int, world: int, args: Any, result: str) -> None:
    join_job(rank, world, port)
    torch.set_num_threads(1)
    x = torch.randint(0, VOCAB, (args.rows, args.seq), generator=torch.Generator().manual_seed(1))
    models, losses, first = {}, {}, {}
    for name, compile_ in (("eager", False), ("compiled", args.backend)):
        config = plait.Config(num_stages=2, num_microbatches=args.microbatches, schedule="1f1b", compile=compile_)
        models[name] = plait.Model(small_gpt2(args.layers, args.width, args.seq), config, optimizer=sgd,
                                   loss=next_token_loss)
        losses[name] = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(models[name].train_on_batch(x, x))
            first.setdefault(name, time.perf_counter() - start)
    problems = [f"loss of step {i}: compiled {c} != eager {e}" for i, (c, e) in
                enumerate(zip(losses["compiled"], losses["eager"])) if abs(c - e) > 1e-5 * abs(e)]
    eager_params = dict(models["eager"].net.named_parameters())
    for pname, p in models["compiled"].net.named_parameters():
        if not p.is_meta and not torch.allclose(p.detach(), eager_params[pname].detach(), rtol=1e-5, atol=2e-5):
            problems.append(f"parameter {pname}: largest difference "
                            f"{(p.detach() - eager_params[pname].detach()).abs().max().item():.3g}")
    verdict: list[Any] = [None] * world
    dist.all_gather_object(verdict, problems)
    if any(verdict):
        raise SystemExit("compiled not equal to eager: " + "; ".join(p for v in verdict for p in v))
    step = alternating_medians({name: (lambda m=m: m.train_on_batch(x, x)) for name, m in models.items()},
                               args.warmup, args.rounds)
    if rank == 0:
        Path(result).write_text(json.dumps({"step": step, "first": first, "losses": losses}))
    leave_job()


def main() -> None:
    parser = gpt2_parser(__doc__.splitlines()[0], seq=128, rows=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    out = json.loads(run_job(rank_main, 2, 2, args))
    step, first = out["step"], out["first"]
    print(f"GPT-2 {args.layers} x {args.width}, {args.rows} x {args.seq} tokens, 2 stages x {args.microbatches} "
          f"micro-batches (1F1B), 2 gloo ranks x 1 thread, {args.rounds} rounds (medians); compile={args.backend!r} "
          f"equal to eager over 3 steps (losses {out['losses']['compiled'][-1]:.6f} / {out['losses']['eager'][-1]:.6f})")
    print(f"  first step               eager {first['eager']:8.2f} s    compiled {first['compiled']:8.2f} s    "
          f"compiling {first['compiled'] - first['eager']:.2f} s")
    print(f"  step time (slowest rank) eager {step['eager'] * 1e3:8.2f} ms   compiled {step['compiled'] * 1e3:8.2f} ms   "
          f"compiled / eager = {step['compiled'] / step['eager']:.3f}")


if __name__ == "__main__":
    main()
