"""Joining (or creating) the process group plait runs on."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

__all__ = ["init_process_group", "choose_backend"]

log = logging.getLogger("plait")

LAUNCH_HINT = "start every rank with `plait run -n N script.py` (or torchrun)"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; {LAUNCH_HINT}") from None


def choose_backend() -> str:
    """"nccl" when every local rank can have a CUDA device of its own, else "gloo"."""
    local_world_size = _env_int("LOCAL_WORLD_SIZE") or 1
    if torch.cuda.is_available():
        devices = torch.cuda.device_count()
        if devices >= local_world_size:
            log.info("plait: backend nccl (%d CUDA devices for %d local ranks)", devices, local_world_size)
            return "nccl"
        log.info("plait: backend gloo (%d CUDA devices for %d local ranks: too few for nccl)",
                 devices, local_world_size)
        return "gloo"
    log.info("plait: backend gloo (no CUDA device)")
    return "gloo"


def init_process_group(timeout_s: float) -> tuple[int, int]:
    """Return (rank, world_size), joining the job's process group if there is one.

    - a group already initialised (by the user or a framework) is used as it is;
    - else a launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as set by
      torchrun and `plait run`) with WORLD_SIZE > 1 creates the group with env://;
    - else this is a single process: (0, 1), and no group is created.
    """
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        log.info("plait: rank %d of %d from the existing process group (backend %s)",
                 rank, world_size, dist.get_backend())
        return rank, world_size

    env_world_size = _env_int("WORLD_SIZE")
    if env_world_size is None or env_world_size <= 1:
        log.info("plait: single process (WORLD_SIZE %s): no process group",
                 "unset" if env_world_size is None else env_world_size)
        return 0, 1
    world_size = env_world_size

    env_rank = _env_int("RANK")
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if env_rank is None or missing:
        raise ValueError(f"WORLD_SIZE={world_size} is set but {', '.join(missing)} is not; {LAUNCH_HINT}")
    rank = env_rank
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size}); {LAUNCH_HINT}")

    backend = choose_backend()
    if backend == "nccl":
        torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)  # one device per local rank
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    log.info("plait: rank %d of %d from the launcher's environment (RANK/WORLD_SIZE), backend %s",
             rank, world_size, backend)
    return rank, world_size
