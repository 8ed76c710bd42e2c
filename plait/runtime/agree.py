"""Agreeing on one JSON value: rank 0 makes it, every rank reads it from the job's key-value store.

Planning profiles the model on rank 0 only (timings differ between processes, so ranks that
each planned could choose different layouts); the others wait for rank 0's answer. The wait
has its own limit, longer than `timeout_s`, since a profile may take longer than any wait
between ranks during a step. A failure on rank 0 travels as well, so no rank waits in vain:

    rank 0:  value = make()  -> store["plait/agree/<n>"] = {"ok": value} | {"error": "..."}
    rank r:  wait for the key -> value, or raise the error rank 0 had (or, where rank 0 failed
             before `agree`, capturing the model, the one it posted: `plait.runtime.failure`)

Every rank calls `agree` the same number of times in the same order (one key per call).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import torch.distributed as dist

from plait import errors
from plait.errors import ConfigError, ModelError, PipelineError, PlaitError, model_frame
from plait.runtime.failure import gather_failures, posted, stopped_by

__all__ = ["agree"]

_calls = {"count": 0}  # keys of this process's calls, in order: the same sequence on every rank


def agree(rank: int, make: Callable[[], Any], what: str, wait_s: float) -> Any:
    """`make()` on rank 0 (a JSON-ready value), the same value on every rank."""
    _calls["count"] += 1
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    key = f"plait/agree/{_calls['count']}"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            value = make()
        except Exception as e:
            frame = None if isinstance(e, PlaitError) else model_frame(e)  # the model's own code raised
            store.set(key, json.dumps({"error": f"{type(e).__name__}: {e}", "frame": frame, "kind": type(e).__name__}))
            if frame is not None:
                raise ModelError(f"the model's code raised {type(e).__name__}: {e}\n  at {frame}\n  while "
                                 f"rank 0 ran it to make the {what}") from e
            raise
        store.set(key, json.dumps({"ok": value}))
        return value
    try:
        stopped = _wait(store, key, wait_s)
        message = None if stopped else json.loads(store.get(key).decode())
    except Exception as e:  # noqa: BLE001 - rank 0 died or is stuck: say so
        raise PipelineError(
            f"rank {rank} waited {wait_s:.0f} s for rank 0's {what} and got none ({type(e).__name__}: "
            f"{e}); rank 0 may have died, or the profile takes longer: raise Config.timeout_s"
        ) from e
    if message is None:  # rank 0 failed before it could make the value (its model raised capturing it)
        where = f"waiting for rank 0's {what}"
        raise stopped_by(rank, gather_failures(-1, rank, -1, 2.0), where) or PipelineError(
            f"rank {rank} stopped {where}: rank 0 posted a failure (its own output says which)")
    if message.get("frame"):
        raise ModelError(f"rank 0 stopped: the model's code raised {message['error']}\n  at {message['frame']}\n  "
                         f"while rank 0 ran it to make the {what} (rank 0's output shows its traceback)")
    if "error" in message:  # the class rank 0 raised, where it is plait's (a wrong layout: ConfigError, PartitionError)
        kind = getattr(errors, str(message.get("kind")), None)
        kind = kind if isinstance(kind, type) and issubclass(kind, PlaitError) else ConfigError
        raise kind(f"rank 0 failed while making the {what}: {message['error']}")
    return message["ok"]


def _wait(store: Any, key: str, wait_s: float) -> bool:
    """Wait for `key` up to `wait_s`; True where rank 0 posted a failure first (it will never set it)."""
    deadline = time.monotonic() + wait_s
    while not store.check([key]):
        if posted(store, 0):
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {key!r} after {wait_s:.0f} s")
        time.sleep(0.05)
    return False
