"""This host as a process sees it: the cores it may use, and the ranks its launcher put on it."""

from __future__ import annotations

import os

__all__ = ["usable_cores", "local_world_size"]


def usable_cores() -> int:
    """The cores this process may run on (its affinity; where there is none, the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_world_size(default: int = 1) -> int:
    """The ranks on this node: LOCAL_WORLD_SIZE as the launcher set it (torchrun, `plait run`;
    plait's process group sets it from Slurm and MPI too), else `default`."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else default
