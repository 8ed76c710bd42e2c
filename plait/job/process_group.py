"""Joining (or creating) the process group plait runs on."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import importlib.util
import logging
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # re-exported without __all__

from plait.errors import ConfigError
from plait.job.host_memory import keep_freed_memory
from plait.job.ranks import RankInfo, is_loopback, resolve_ranks
from plait.job.ranks import local_world_size as local_world_size_of_env
from plait.job.together import mark_ended

__all__ = ["init_process_group", "choose_backend", "resolve_ranks", "RankInfo", "create_store",
           "loopback_interface_env"]

log = logging.getLogger("plait")


def choose_backend(local_world_size: int | None = None) -> str:
    """"nccl" when every local rank can have a CUDA device of its own, else "gloo".

    `local_world_size` defaults to LOCAL_WORLD_SIZE from the environment, else 1.
    """
    if local_world_size is None:
        local_world_size = local_world_size_of_env()
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


def loopback_interface_env() -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the loopback interface, unless already set.

    Gloo (and NCCL's bootstrap) otherwise listen on the address the host name resolves to, which
    on most machines is reachable from the network.
    """
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is None:
        return {}
    return {var: loopback for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if var not in os.environ}


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def create_store(host: str, port: int, is_master: bool, timeout: datetime.timedelta,
                 world_size: int | None = None) -> TCPStore:
    """A TCPStore at host:port; the master listens only on `host` when it is a loopback address.

    torch's TCPStore server listens on every interface whatever host it is given; handed a socket
    already bound to 127.0.0.1 (master_listen_fd, libuv backend) it listens only there.
    """
    if not is_master:
        return TCPStore(host, port, world_size, False, timeout)
    in_use = ConfigError(f"port {port} is already in use on this machine, where rank 0 hosts the job's "
                         f"store: set MASTER_PORT to a free port (the same on every rank)")
    if not is_loopback(host):
        # Several nodes: the others must reach this store, so it listens on every interface.
        try:
            return TCPStore(host, port, world_size, True, timeout, wait_for_workers=False)
        except RuntimeError as err:
            if "EADDRINUSE" in str(err):
                raise in_use from None
            raise
    try:
        sock = _listen(host, port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise in_use from None
        raise
    bound_port = int(sock.getsockname()[1])  # the OS's choice when port is 0
    fd = sock.detach()  # the store owns the descriptor from here on, and closes it with the server
    try:
        return TCPStore(host, bound_port, world_size, True, timeout, wait_for_workers=False,
                        master_listen_fd=fd, use_libuv=True)
    except BaseException:
        with contextlib.suppress(OSError):  # the store may have closed it already
            os.close(fd)
        raise


def _mpi4py_agree() -> tuple[str, int]:
    """Rank 0's host name and a free port on it, broadcast to every rank through MPI (no pickle)."""
    MPI = importlib.import_module("mpi4py.MPI")  # optional; importing it runs MPI_Init

    comm = MPI.COMM_WORLD
    buf = bytearray(256)
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        # The host name as other nodes know it; getfqdn() can answer "localhost" where /etc/hosts
        # maps the host name to a loopback address, as Debian's does.
        buf[:] = f"{socket.gethostname()} {port}".encode().ljust(256)
    comm.Bcast([buf, MPI.BYTE], root=0)
    host, port_text = buf.decode().split()
    return host, int(port_text)


def init_process_group(
    timeout_s: float,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    local_rank: int | None = None,
) -> tuple[int, int]:
    """Return (rank, world_size), joining the job's process group if there is one.

    - a group already initialised (by the user or a framework) is used as it is;
    - else the first launcher found by `resolve_ranks` (explicit arguments, torchrun/elastic,
      Slurm, Open MPI, MPICH/PMI; see plait.job.ranks) says this rank, the world size and
      where rank 0 hosts the job's store; a world of one process creates no group.
    A job whose master is a loopback address has every listening socket on 127.0.0.1.
    """
    if dist.is_initialized():
        existing = dist.get_rank(), dist.get_world_size()
        log.info("plait: rank %d of %d from the existing process group (backend %s)",
                 *existing, dist.get_backend())
        if dist.get_backend() == "gloo":
            keep_freed_memory()  # CPU ranks: a step's large buffers reused, not faulted in again
        return existing

    agree = _mpi4py_agree if importlib.util.find_spec("mpi4py") is not None else None
    info = resolve_ranks(os.environ, rank=rank, world_size=world_size, local_rank=local_rank,
                         master_addr=master_addr, master_port=master_port, agree=agree)
    if info.world_size == 1:
        log.info("plait: single process (%s): no process group", info.describe())
        return 0, 1

    backend = choose_backend(info.local_world_size)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)  # one device per local rank
    else:
        keep_freed_memory()  # CPU ranks: a step's large buffers reused, not faulted in again
    if info.loopback:
        os.environ.update(loopback_interface_env())  # read by gloo/NCCL when the group is made
    log.info("plait: %s, backend %s", info.describe(), backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    assert info.master_addr is not None and info.master_port is not None
    # Under torchrun (and `plait run`) the launcher hosts the store and every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and info.source == "torchrun"
    store: Store = create_store(info.master_addr, info.master_port, info.rank == 0 and not agent_store, timeout,
                                world_size=None if agent_store else info.world_size)
    if agent_store:
        # The agent keeps one store across restarts (--max-restarts): without a key space per
        # attempt, gloo would read the addresses of the previous attempt's dead ranks.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = PrefixStore(f"plait/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout)
    # A group left to the interpreter's teardown can abort the process after a clean run
    # ("terminate called without an active exception" from a backend thread): plait made it,
    # so plait ends it, once the user's code is done.
    atexit.register(_destroy)
    return info.rank, info.world_size


def _destroy() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer waiting in state_dict() learns that this rank will not come
            mark_ended()
        with contextlib.suppress(Exception):  # a peer already gone must not turn exit into a failure
            dist.destroy_process_group()
    # A gloo worker thread that finished the last collective may still hold its work, and
    # releasing the work's tensors takes the GIL: during interpreter finalization that kills
    # the thread and aborts the process (seen with gdb after `model.state_dict()`'s broadcasts
    # on some clean 2-rank runs). The interpreter is still whole here: let it go first.
    time.sleep(_RELEASE_S)


_RELEASE_S = 0.05  # seconds; the release itself takes microseconds once the thread runs
