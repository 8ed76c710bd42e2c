"""Failure reports: every failing rank posts where it stood, and each report shows them all.

When a rank's wait times out, its peers are usually stuck too and time out moments later. Each
posts its schedule position to the job's key-value store and waits briefly for the others, so
the grid in every report marks every rank that could answer. Used only on failure: a healthy
step never touches the store.
"""

from __future__ import annotations

import time

import torch.distributed as dist

__all__ = ["gather_positions"]


def gather_positions(run_id: int, rank: int, position: int, wait_s: float = 3.0) -> dict[int, int]:
    """Post this rank's position for run `run_id`; return every position posted within `wait_s`."""
    positions = {rank: position}
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return positions
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"plait/position/{run_id}/{rank}", str(position))
        keys = {r: f"plait/position/{run_id}/{r}" for r in range(dist.get_world_size())}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not store.check(list(keys.values())):
            time.sleep(0.1)
        for r, key in keys.items():
            if r != rank and store.check([key]):
                positions[r] = int(store.get(key))
    except Exception:  # noqa: BLE001 - the store may be gone with a dead rank; report what we have
        pass
    return positions
