"""Activation memory and step time of sequence parallelism at tp = 2 (Config(sequence_parallel=True)).

One job, spawned here: 2 gloo ranks on 127.0.0.1, one CPU thread each. The model: Hugging Face
GPT-2 (`--layers` x `--width`, 4 heads, vocabulary 1024), dropout 0.1 on the embeddings and the
residual branches (attention dropout 0, so attention splits by heads), batch `--rows` x `--seq`
tokens, one micro-batch, SGD:

    tp      plait.Model(net, Config(tp=2)): Megatron's layout, each row-parallel sum all-reduced
    tp+sp   Config(tp=2, sequence_parallel=True): each row-parallel sum reduce-scattered over the
            tokens; layer norms, dropouts and residual adds on half the tokens; gathered before
            the next column-parallel linear

Both are first checked equal to one process drawing the same dropout masks (the loss of 3 steps).
Then the activation peak of a step (`model.memory_stats()["activations_peak_bytes"]`: the bytes
held for the backward at once, measured) and the step time (medians over alternating rounds, each
step the slowest rank's). Printed: both sides and the ratios, sp over plain.

    python benchmarks/sequence_parallel.py [--rounds 10] [--layers 4] [--width 256] [--seq 256] [--rows 4]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import plait
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plait

from job import VOCAB, gpt2_parser, next_token_loss, peaks_and_steps, small_gpt2  # noqa: E402 - benchmarks/ is the script's own directory on sys.path



def build(args: argparse.Namespace) -> torch.nn.Module:
    return small_gpt2(args.layers, args.width, args.seq, dropout=0.1)


lm_loss = next_token_loss


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.randint(0, VOCAB, (args.rows, args.seq), generator=torch.Generator().manual_seed(1))
    models, problems = {}, []
    for name, sp in (("tp", False), ("tp+sp", True)):
        net = build(args)
        ref = copy.deepcopy(net)
        ref_opt = sgd(ref.parameters())
        model = plait.Model(net, plait.Config(tp=world, num_microbatches=1, sequence_parallel=sp), optimizer=sgd,
                            loss=lm_loss)
        model.build(x)
        state = torch.get_rng_state()
        got = [model.train_on_batch(x, x) for _ in range(3)]
        torch.set_rng_state(state)  # one process draws the same masks
        for step, value in enumerate(got):
            ref_opt.zero_grad()
            loss = lm_loss(ref(input_ids=x), x)
            loss.backward()
            ref_opt.step()
            if abs(value - float(loss)) > 1e-5 * abs(float(loss)) + 1e-6:
                problems.append(f"{name} loss of step {step}: {value} != {float(loss)}")
        models[name] = model
    memory, step = peaks_and_steps(models, x, problems, args.warmup, args.rounds)
    if rank == 0:
        out.put((memory, step))
    dist.destroy_process_group()


def main() -> None:
    parser = gpt2_parser(__doc__.splitlines()[0], seq=256, rows=4)
    args = parser.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Queue()
    mp.start_processes(rank_main, args=(2, port, args, out), nprocs=2, start_method="spawn")
    memory, step = out.get(timeout=5)
    print(f"GPT-2 {args.layers} x {args.width}, {args.rows} x {args.seq} tokens, dropout 0.1, 2 gloo ranks x 1 thread, "
          f"{args.rounds} rounds (medians); both equal to one process (3 steps)")
    for name in ("tp", "tp+sp"):
        print(f"  {name:6s} activations {memory[name] / 2**20:8.2f} MiB   step {step[name] * 1e3:8.2f} ms")
    print(f"activations sp / plain = {memory['tp+sp'] / memory['tp']:.3f}")
    print(f"step time   sp / plain = {step['tp+sp'] / step['tp']:.3f}")


if __name__ == "__main__":
    main()
