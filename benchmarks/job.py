"""A benchmark's job: its ranks spawned on 127.0.0.1, one thread each, and the MLP workload they share."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = ["mlp", "regression_batch", "run_job", "join_job", "leave_job", "timed", "one_rank_group"]


def mlp(width: int, layers: int, seed: int) -> nn.Sequential:
    """layers x (Linear(width, width), ReLU), identical on every rank (fixed seed)."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def regression_batch(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), both (rows, width) standard normal, identical on every rank for one seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)  # (B, width)
    return x, torch.randn(rows, width, generator=g)  # (B, width)


def one_rank_group() -> None:
    """This process as a one-rank NCCL group on GPU 0: how a plait rank runs on a one-GPU machine."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_job(rank: int, world_size: int, port: int) -> None:
    """In a spawned rank: one CPU thread, and the gloo process group on 127.0.0.1:port."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def leave_job() -> None:
    """At the end of a rank: destroy the group, then give gloo's workers a moment to release the
    last collective's tensors before the interpreter ends (else the process may abort at exit)."""
    dist.destroy_process_group()
    time.sleep(0.05)


def run_job(rank_main: Callable[..., None], world_size: int, *args: Any) -> str:
    """Spawn rank_main(rank, port, *args, result_path) on `world_size` ranks; return what rank 0
    wrote to result_path (the ranks call join_job first and destroy the group at the end)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        mp.start_processes(rank_main, args=(_free_port(), *args, str(result)), nprocs=world_size,
                           join=True, start_method="spawn")
        return result.read_text()


def timed(step: Callable[[], Any]) -> float:
    """Wall seconds of one step on the slowest rank, started after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    step()
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return float(wall)


def alternating_medians(steps: dict[str, Callable[[], Any]], warmup: int, rounds: int) -> dict[str, float]:
    """The median `timed` seconds of each named step over `rounds` rounds after `warmup`, the
    steps run in turn, their order reversed every other round (so neither always goes first)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(warmup + rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            seconds = timed(steps[name])
            if r >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


VOCAB = 1024  # the small GPT-2's vocabulary


def small_gpt2(layers: int, width: int, seq: int, dropout: float = 0.0) -> nn.Module:
    """Hugging Face GPT-2 of `layers` x `width`, 4 heads, vocabulary VOCAB, `seq` positions, no
    cache; `dropout` on the embeddings and residual branches (attention dropout 0); seed 0."""
    import transformers
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=seq,
                                  use_cache=False, bos_token_id=0, eos_token_id=0, attn_pdrop=0.0,
                                  resid_pdrop=dropout, embd_pdrop=dropout)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def next_token_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each position's logits against the next token of `y`."""
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), y[:, 1:].reshape(-1))


def gpt2_parser(description: str, seq: int, rows: int) -> argparse.ArgumentParser:
    """The options of a benchmark timing a small GPT-2 (`small_gpt2`) in alternating rounds."""
    parser = argparse.ArgumentParser(description=description)
    for name, default in (("rounds", 10), ("warmup", 2), ("layers", 4), ("width", 256), ("seq", seq), ("rows", rows)):
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser


def peaks_and_steps(models: dict[str, Any], x: Any, problems: list[str], warmup: int,
                    rounds: int) -> tuple[dict[str, Any], dict[str, float]]:
    """Each checked plait model's activation peak (`memory_stats`) and median step on batch `x`
    (`alternating_medians`); a benchmark whose models were not equal to one process stops here."""
    if problems:
        raise SystemExit("not equal to one process: " + "; ".join(problems))
    memory = {name: m.memory_stats()["activations_peak_bytes"] for name, m in models.items()}
    return memory, alternating_medians({name: (lambda m=m: m.train_on_batch(x, x)) for name, m in models.items()},
                                       warmup, rounds)
