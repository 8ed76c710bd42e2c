"""The wait for a collective or message: polled where each of a node's gloo ranks has a core, else blocked.

A blocked wait lets the rank's core go idle until the transport thread wakes it. On a virtual
machine an idle virtual core is halted, and waking it again is up to the host's scheduler: a
64 KiB gloo all-reduce between two idle ranks took a scheduler tick (~4 ms) one time in five to ten,
against a median of 0.4 ms (docs/benchmarks.md, "Waiting for gloo"). A polled wait keeps the core
running and hands it to every other runnable thread at once (`os.sched_yield`), as MPI's busy
polling does: the transport's threads get the core the moment they are woken.

Polling takes a core's whole time, so it is chosen only where it costs no one else's: the process
group's backend is gloo and the node's ranks (LOCAL_WORLD_SIZE; else the whole world, as if on one
node) are no more than this process's cores. NCCL's work is left to its own wait (a CUDA stream
wait, not a host one). `PLAIT_WAIT=poll` or `block` overrides the choice.

Only the Work of a gloo collective that runs on gloo's worker threads (all-reduce, all-gather,
reduce, broadcast) says when it is done (`is_completed`); a send's, a receive's and
reduce_scatter_tensor's say so only from `wait`, so their callers block on them.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch.distributed as dist

from plait.errors import ConfigError
from plait.host import local_world_size, usable_cores

__all__ = ["finish", "polls", "WAIT_ENV"]

WAIT_ENV = "PLAIT_WAIT"
_CHOICES = ("poll", "block")


def polls() -> bool:
    """True where this process polls its waits (see the module)."""
    forced = os.environ.get(WAIT_ENV, "").strip().lower()
    if forced:
        if forced not in _CHOICES:
            raise ConfigError(f"{WAIT_ENV}={forced!r} is not a way to wait; set it to one of {_CHOICES} "
                              f"or leave it unset for the default (poll on gloo ranks with a core each)")
        return forced == "poll"
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return False
    return local_world_size(dist.get_world_size()) <= usable_cores()  # unknown: all ranks on this node


def finish(work: Any, timeout: datetime.timedelta | None = None) -> None:
    """Wait for `work` (a `torch.distributed` Work), polling or blocking as `polls()` says; errors and
    timeouts are the Work's own (`work.wait` raises them)."""
    if work is None:
        return
    if polls():
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not work.is_completed():
            if deadline is not None and time.monotonic() > deadline:
                timeout = datetime.timedelta(milliseconds=1)  # past the caller's limit: let wait say so
                break
            os.sched_yield()
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
