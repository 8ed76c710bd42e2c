"""Bytes crossing the cut, activation memory and step time of a bf16 pipeline against fp32 (Config(precision=...)).

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each, a 2-stage pipeline
(`Config(num_stages=2, num_microbatches=--microbatches)`). The model: Hugging Face GPT-2 (`--layers`
x `--width`, 4 heads, vocabulary 1024, no dropout), batch `--rows` x `--seq` tokens, SGD:

    fp32    Config(precision="fp32"): the default
    bf16    Config(precision="bf16"): each stage computes with bf16 copies of its parameters over
            the fp32 masters (plait.runtime.precision)

bf16 is first checked against plain PyTorch by hand in one process (a bf16 copy computes each
micro-batch, fp32 masters step): the loss of 3 steps must agree to 1e-6. Then, per step: the bytes
that cross the cut (every tensor the wire sends, both directions: activations forward, their
gradients back), the activation peak (`model.memory_stats()["activations_peak_bytes"]`: the
bytes held for backward passes at once, measured) and the step time (medians over alternating
rounds, each the slowest rank's). Printed: both sides and the ratios, bf16 over fp32 (targets:
<= 0.55 for the bytes and the activations; the step time is reported as measured: a CPU without
bf16 units may run bf16 slower).

    python benchmarks/precision.py [--rounds 10] [--layers 4] [--width 256] [--seq 128] [--rows 8]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plait

from job import (VOCAB, gpt2_parser, join_job, leave_job, next_token_loss, peaks_and_steps,  # noqa: E402
                 run_job, small_gpt2)  # benchmarks/ is the script's own directory on sys.path

from plait.runtime.comm.wire import Wire  # noqa: E402

TARGET = 0.55
SENT = {"bytes": 0}


def count_sends() -> None:
    """Count the bytes of every tensor the wire sends (the cut's traffic), in this process."""
    for name in ("send", "send_tensors"):  # activations (and what rides with them); gradients back
        original = getattr(Wire, name)

        def counted(self: Wire, values: Any, *args: Any, _send: Any = original, **kwargs: Any) -> Any:
            SENT["bytes"] += sum(t.numel() * t.element_size() for t in pytree.tree_leaves(values)
                                 if isinstance(t, torch.Tensor))
            return _send(self, values, *args, **kwargs)

        setattr(Wire, name, counted)


def build(args: argparse.Namespace) -> torch.nn.Module:
    return small_gpt2(args.layers, args.width, args.seq, dropout=0.0)


lm_loss = next_token_loss


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)


def by_hand_losses(net: torch.nn.Module, x: torch.Tensor, microbatches: int, steps: int) -> list[float]:
    """One process: a bf16 copy computes each micro-batch, fp32 masters step (the embedding and
    the LM head, tied across the two stages, get a copy each, as on the two ranks)."""
    master = copy.deepcopy(net)
    low = copy.deepcopy(net)
    for p in low.parameters():
        p.data = p.data.to(torch.bfloat16)
    low.lm_head.weight = torch.nn.Parameter(low.transformer.wte.weight.detach().clone())
    pairs = [(lp, mp_) for lp, mp_ in zip(low.parameters(), master.parameters())] + [
        (low.lm_head.weight, master.transformer.wte.weight)]
    opt, out = sgd(master.parameters()), []
    for _ in range(steps):
        with torch.no_grad():
            for lp, mp_ in pairs:
                lp.copy_(mp_)
        total = 0.0
        for part in x.chunk(microbatches):
            logits = low(input_ids=part).logits.float()
            loss = lm_loss(logits, part) * (len(part) / len(x))
            loss.backward()
            total += float(loss.detach())
            for lp, mp_ in pairs:
                if lp.grad is not None:
                    mp_.grad = lp.grad.float() if mp_.grad is None else mp_.grad + lp.grad.float()
                    lp.grad = None
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


def rank_main(rank: int, port: int, world: int, args: argparse.Namespace, result: str) -> None:
    join_job(rank, world, port)
    count_sends()
    x = torch.randint(0, VOCAB, (args.rows, args.seq), generator=torch.Generator().manual_seed(1))
    models, problems, sent = {}, [], {}
    for precision in ("fp32", "bf16"):
        net = build(args)
        want = by_hand_losses(net, x, args.microbatches, 3) if precision == "bf16" else None
        model = plait.Model(net, plait.Config(num_stages=2, num_microbatches=args.microbatches, precision=precision),
                            optimizer=sgd, loss=lm_loss)
        got = [model.train_on_batch(x, x) for _ in range(3)]
        for step, (g, w) in enumerate(zip(got, want or got)):
            if abs(g - w) > 1e-6:
                problems.append(f"{precision} loss of step {step}: {g} != {w} (one process by hand)")
        before = SENT["bytes"]
        model.train_on_batch(x, x)
        sent[precision] = SENT["bytes"] - before
        models[precision] = model
    memory, step = peaks_and_steps(models, x, problems, args.warmup, args.rounds)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (sent, memory))
    if rank == 0:
        Path(result).write_text(json.dumps([gathered, step]))
    leave_job()


def main() -> None:
    parser = gpt2_parser(__doc__.splitlines()[0], seq=128, rows=8)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    gathered, step = json.loads(run_job(rank_main, 2, 2, args))
    print(f"GPT-2 {args.layers} x {args.width}, {args.rows} x {args.seq} tokens, 2 stages x {args.microbatches} "
          f"micro-batches, 2 gloo ranks x 1 thread, {args.rounds} rounds (medians); bf16 equal to one process "
          "by hand (3 steps)")
    ratios = {}
    for kind, index in (("bytes across the cut", 0), ("activation peak", 1)):
        for rank, values in enumerate(gathered):
            fp32, bf16 = values[index]["fp32"], values[index]["bf16"]
            ratios[f"{kind}, rank {rank}"] = bf16 / fp32
            print(f"  rank {rank} {kind:22s} fp32 {fp32 / 2**20:9.3f} MiB   bf16 {bf16 / 2**20:9.3f} MiB   "
                  f"bf16 / fp32 = {bf16 / fp32:.3f}")
    print(f"  step time (slowest rank)        fp32 {step['fp32'] * 1e3:9.2f} ms    bf16 {step['bf16'] * 1e3:9.2f} ms    "
          f"bf16 / fp32 = {step['bf16'] / step['fp32']:.3f}")
    worst = max(ratios.values())
    print(f"largest bytes/activation ratio {worst:.3f} (target <= {TARGET}): {'met' if worst <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
