"""Spawning N gloo ranks on 127.0.0.1 for a test, with a hard timeout; results come back as files."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any],
           args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` spawned ranks; return each rank's result.

    Fails (and kills every rank) if any rank raises or the whole run exceeds `timeout` seconds.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world_size, free_port(), out_dir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in {timeout}s")
        except mp.ProcessRaisedException as e:  # pragma: no cover - _entry catches everything
            raise AssertionError(str(e)) from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} left no result (exit code {ctx.processes[rank].exitcode})")
            status, value = torch.load(path, weights_only=False)
            if status != "ok":
                raise AssertionError(value)
            results.append(value)
        return results
