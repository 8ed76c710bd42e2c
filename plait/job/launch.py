"""Starting N local ranks through torch's elastic launcher, on one node or several."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import socket
import uuid
from typing import TYPE_CHECKING, Iterator

from plait.job.ranks import is_loopback, threads_per_rank

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["LaunchSpec", "build_args", "start", "free_port", "LOOPBACK_RENDEZVOUS"]

log = logging.getLogger("plait")

LOCALHOST = "127.0.0.1"
LOOPBACK_RENDEZVOUS = "plait-loopback"  # the rendezvous backend of a one-node job (see below)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What to start and where (`plait run`'s options), checked: `start(spec)` runs it."""

    target: str  # a script path, or a module name when `module` is true
    target_args: tuple[str, ...]
    nproc: int  # ranks on this node
    module: bool = False
    max_restarts: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # node 0's address; required on several nodes, unused on one
    master_port: int | None = None  # node 0's port; required on several nodes; on one, None: any free

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1 (nproc: {self.nproc})")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more (max_restarts: {self.max_restarts})")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be at least 1 (nnodes: {self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in 0..{self.nnodes - 1} (node_rank: {self.node_rank}, nnodes: {self.nnodes})"
            )
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, or 0 for any free port on one node "
                             f"(master_port: {self.master_port})")
        if self.nnodes > 1 and (self.master_addr is None or not self.master_port):
            missing = [name for name, value in (("--master-addr", self.master_addr),
                                                ("--master-port", self.master_port)) if not value]
            raise ValueError(
                f"with nnodes={self.nnodes}, every node needs the same --master-addr and --master-port "
                f"(node 0's address and a free port on it); missing: {', '.join(missing)}"
            )


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def build_args(spec: LaunchSpec, port: int | None = None) -> list[str]:
    """The `torch.distributed.run` (torchrun) command line for `spec`.

    One node rendezvouses through plait's loopback backend: its stores listen on 127.0.0.1 only,
    on `port` (default spec.master_port, else 0: a port the OS picks, so none to collide with).
    Several nodes use torch's static rendezvous: each node is told its rank and node 0's address,
    and node 0's store listens on every interface.
    """
    args = [f"--nproc-per-node={spec.nproc}", f"--max-restarts={spec.max_restarts}"]
    if spec.nnodes == 1:
        if port is None:
            port = spec.master_port if spec.master_port is not None else 0
        args += [
            "--nnodes=1",
            f"--rdzv-backend={LOOPBACK_RENDEZVOUS}",
            f"--rdzv-endpoint={LOCALHOST}:{port}",
            f"--rdzv-id={uuid.uuid4().hex}",
            f"--local-addr={LOCALHOST}",  # the address the ranks are told for the store (MASTER_ADDR)
        ]
    else:
        args += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            f"--master-addr={spec.master_addr}",
            f"--master-port={spec.master_port}",
        ]
    if spec.module:
        args.append("--module")
    return args + [spec.target, *spec.target_args]


# A one-node job's rendezvous. torch's c10d backend would do, except that its two TCP stores (the
# rendezvous' own, and the one the ranks bootstrap their process group from) listen on every
# interface whatever address they are given. This backend is torch's dynamic rendezvous on the
# c10d backend with both stores made by plait.job.process_group.create_store, which hands
# torch a socket bound to 127.0.0.1.
#
#   plait run (agent) ── rendezvous store 127.0.0.1:P ── (only this agent joins)
#        └── bootstrap store 127.0.0.1:Q  <── rank 0 .. rank N-1 (MASTER_ADDR=127.0.0.1, MASTER_PORT=Q)


def _create_loopback_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from plait.job.process_group import create_store

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler reports the name it was asked for
            return LOOPBACK_RENDEZVOUS

    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    read_timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    store = create_store(LOCALHOST, port, True, read_timeout)
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The handler makes the ranks' bootstrap store with this private method of torch's; ours binds
    # loopback. tests/test_launch.py checks every listening address of a `plait run` job.
    assert hasattr(handler, "_create_tcp_store_server"), "torch's DynamicRendezvousHandler changed"
    handler._create_tcp_store_server = (  # type: ignore[method-assign]
        lambda master_addr, master_port: create_store(LOCALHOST, master_port, True, datetime.timedelta(seconds=300))
    )
    return handler


def _register_loopback_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _create_loopback_handler)  # idempotent


@contextlib.contextmanager
def _child_env(spec: LaunchSpec) -> Iterator[None]:
    """Set the ranks' environment (unless the user did), and restore ours afterwards.

    OMP_NUM_THREADS shares the cores among the local ranks (every node's, where node 0's address is
    a loopback one: all the nodes are then on this machine, and more threads than cores slow small
    matmuls tenfold and more); on one node, GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME make the
    ranks' own sockets listen on the loopback interface too.
    """
    from plait.job.process_group import loopback_interface_env

    here = spec.nproc * (spec.nnodes if spec.master_addr is not None and is_loopback(spec.master_addr) else 1)
    wanted = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(threads_per_rank(here))}
    if spec.nnodes == 1:
        wanted.update(loopback_interface_env())
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name in wanted:
            os.environ.pop(name, None)


def _exit_code(code: int) -> int:
    """A failed rank's exit code as a shell reports it (a signal N becomes 128 + N)."""
    if code > 0:
        return code
    if code < 0:
        return 128 - code
    return 1  # the rank "failed" with code 0: still a failure of the job


def start(spec: LaunchSpec) -> int:
    """Run the spec's target on its local ranks; 0, or the failing rank's exit code."""
    # Run torchrun in this process rather than as a subprocess: its ChildFailedError tells
    # which ranks failed and how, so the report below is one line per rank instead of
    # torchrun's own traceback. Imported here because it is slow and only `plait run` needs it.
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if spec.nnodes == 1:
        _register_loopback_rendezvous()
        if spec.master_addr is not None and spec.master_addr != LOCALHOST:
            log.warning("plait run: one node listens on %s only; --master-addr %s is for --nnodes > 1",
                        LOCALHOST, spec.master_addr)
    parsed = torchrun.parse_args(build_args(spec))  # type: ignore[no-untyped-call]  # torch's
    try:
        with _child_env(spec):
            torchrun.run(parsed)  # type: ignore[no-untyped-call]
    except ChildFailedError as err:
        first_rank, first = err.get_first_failure()
        for rank, failure in sorted(err.failures.items()):
            how = f"exit code {failure.exitcode}"
            if failure.exitcode < 0:
                with contextlib.suppress(ValueError):
                    how = f"signal {signal.Signals(-failure.exitcode).name}"
            log.error(
                "plait run: rank %d (local rank %d, pid %d) of %s failed with %s%s",
                rank, failure.local_rank, failure.pid, spec.target, how,
                " (first failure)" if rank == first_rank and len(err.failures) > 1 else "",
            )
        log.error("plait run: the failing rank's own traceback, if any, is printed above")
        return _exit_code(first.exitcode)
    except SignalException as err:  # Ctrl-C or a kill: the launcher has stopped every rank
        log.error("plait run: stopped by %s; every rank of %s was stopped", err.sigval.name, spec.target)
        return 128 + int(err.sigval)
    return 0
