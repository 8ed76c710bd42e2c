"""The rings of this process's job: made once per process group, used by every pipeline's wire.

`shared_rings` gives the `Rings` (rings.py) of the default group where pipeline messages may go
by shared memory -- CPU ranks on gloo, x86-64, /dev/shm there, `PLAIT_RINGS` not 0 -- and None
elsewhere; `close_all` marks them closed when this rank stops after a failure (`stop_peers`).
"""

from __future__ import annotations

import os
import platform
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime.comm.rings import SHM, Rings

__all__ = ["RINGS_ENV", "usable", "shared_rings", "close_all"]

RINGS_ENV = "PLAIT_RINGS"
_SHARED: dict[int, tuple[Any, Rings | None]] = {}  # id of the default group -> (the group, its rings or None)


def usable() -> bool:
    """Whether rings may carry this process's messages: gloo, x86-64, /dev/shm, not turned off."""
    if os.environ.get(RINGS_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return (platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM)
            and dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() > 1)


def shared_rings(device: torch.device, timeout_s: float, polls: bool) -> Rings | None:
    """The rings of this process's default group (one set, kept), or None where messages go by
    gloo (a GPU device, another backend, `usable()` false). Nothing waits here: each link is
    made when first used."""
    if device.type != "cpu" or not usable():
        return None
    group = dist.distributed_c10d._get_default_group()
    if id(group) not in _SHARED:  # the group is kept with its rings: its id is not reused while they are
        store = dist.distributed_c10d._get_default_store()
        _SHARED[id(group)] = (group, Rings(dist.get_rank(), store, timedelta(seconds=timeout_s), polls))
    return _SHARED[id(group)][1]


def close_all() -> None:
    """Mark every ring of this process closed (a failing rank's `stop_peers`)."""
    for _, rings in _SHARED.values():
        if rings is not None:
            rings.close()
