"""Starting N gloo ranks on 127.0.0.1 for a test, with a hard timeout; results come back as files.

Ranks start from multiprocessing's fork server, which imports torch, plait and transformers once
(`tests.rank_preload`) and forks a fresh rank from that state: a spawned interpreter imports them
again for every rank of every test, 1.5-3 s a launch on 2 cores. A rank gets what a spawned one
would: the test process's environment and working directory at launch and its own random seed.
PLAIT_TEST_START_METHOD=spawn starts them the old way.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Collection

import torch
import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port"]

START_METHOD_ENV = "PLAIT_TEST_START_METHOD"
PRELOAD = ["tests.rank_preload"]


def _start_method() -> str:
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: choose forkserver or spawn")
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first launch)
    return method


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any],
           args: tuple[Any, ...], dying: Collection[int], env: dict[str, str], cwd: str) -> None:
    os.environ.clear()  # the fork server's environment is the one it started with: the test's now
    os.environ.update(env)
    os.chdir(cwd)
    random.seed()  # forked ranks share the server's state; spawned ones seed their own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    # Rank 0 hosts the job's store: every rank stays until the others have their results
    # (a rank still reporting a fault needs the store), or 30 s have passed.
    others = [os.path.join(out_dir, f"{r}.pt") for r in range(world_size) if r not in dying]
    until = time.monotonic() + 30.0
    while not all(os.path.exists(p) for p in others) and time.monotonic() < until:
        time.sleep(0.05)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # The result is on disk: end here. Interpreter finalization can abort in gloo's worker
    # threads ("terminate called without an active exception", pytorch/pytorch#179291),
    # which would fail a test whose ranks all succeeded. A rank that dies before this
    # line leaves no result and still fails the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 90.0,
              dying: Collection[int] = ()) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` spawned ranks; return each rank's result.

    Fails (and kills every rank) if any rank raises or the whole run exceeds `timeout` seconds.
    Ranks in `dying` are expected to be killed by a signal (the test kills them): their result
    is None, and it is a failure if one of them ends any other way.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        launch = (world_size, free_port(), out_dir, fn, args, tuple(dying), dict(os.environ), os.getcwd())
        ctx = mp.start_processes(_entry, args=launch, nprocs=world_size, join=False, start_method=_start_method())
        deadline = time.monotonic() + timeout
        try:
            if dying:  # ctx.join would stop the others when one dies: they must end by themselves
                for p in ctx.processes:
                    p.join(max(0.0, deadline - time.monotonic()))
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                if alive:
                    raise TimeoutError(f"ranks {alive} running {fn.__name__} did not finish in {timeout}s")
            while not dying and not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
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
            if rank in dying:
                code = ctx.processes[rank].exitcode
                if code is None or code >= 0:
                    raise AssertionError(f"rank {rank} was to be killed by a signal, but it ended with "
                                         f"exit code {code}" + _result_text(path))
                results.append(None)
                continue
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} left no result (exit code {ctx.processes[rank].exitcode})")
            status, value = torch.load(path, weights_only=False)
            if status != "ok":
                raise AssertionError(value)
            results.append(value)
        return results


def _result_text(path: str) -> str:
    if not os.path.exists(path):
        return ""
    status, value = torch.load(path, weights_only=False)
    return f" ({status}: {value})"
