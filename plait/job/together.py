"""Calls every rank must make together (`state_dict`): a rank that comes alone is told so, at once.

`model.state_dict()` gathers each stage's tensors from the ranks that hold them, so it is a
collective: `if rank == 0: torch.save(model.state_dict(), path)` leaves rank 0 in a gather that no
peer joins, and gloo answers with `Connection closed by peer` (the peers' scripts ended) or a
receive timeout. Before the first collective, each rank counts itself in under the job's store
and waits for the others, watching for the mark a rank leaves when its script ends
(`plait.job.process_group`):

    rank r:  store["plait/together/<n>"] += 1;  wait until it is world_size
             (a rank's "plait/ended/<rank>" set meanwhile, or timeout_s passed: a ConfigError
              that names the ranks missing and says to call it on every rank)

Every rank calls `meet` the same number of times in the same order (one key per call).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from plait.errors import ConfigError

__all__ = ["meet", "mark_ended"]

ENDED_KEY = "plait/ended"  # counts the ranks whose script has ended; each also sets ENDED_KEY/<rank>
_calls = {"count": 0}  # this process's calls, in order: the same sequence on every rank
_POLL_S = (0.005, 0.2)  # the first and the longest pause between two looks at the store


def mark_ended() -> None:
    """Leave this rank's mark in the job's store: its script has ended (called at exit)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{ENDED_KEY}/{dist.get_rank()}", "1")
    store.add(ENDED_KEY, 1)


def meet(what: str, fix: str, timeout_s: float) -> None:
    """Wait until every rank has called `meet` as often as this one; a ConfigError naming the
    ranks missing (and `fix`) if one ended without it, or none came within `timeout_s`."""
    _calls["count"] += 1
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    world_size, rank = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    key = f"plait/together/{_calls['count']}"
    came = store.add(key, 1)
    deadline, pause = time.monotonic() + timeout_s, _POLL_S[0]
    while came < world_size:
        ended = [r for r in range(world_size) if r != rank and store.check([f"{ENDED_KEY}/{r}"])] \
            if store.add(ENDED_KEY, 0) else []
        if ended or time.monotonic() > deadline:
            why = (f"ranks {ended} ended their script without calling it" if ended else
                   f"{world_size - came} of the {world_size} ranks did not call it within {timeout_s:g} s "
                   "(Config.timeout_s)")
            raise ConfigError(f"{what} is a collective: every rank must call it, and {why}. {fix}")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])
        came = store.add(key, 0)
