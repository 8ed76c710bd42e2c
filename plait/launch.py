"""Starting N local ranks through torch's elastic launcher."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import uuid
from typing import Iterator

__all__ = ["LaunchSpec", "build_args", "run", "run_module", "free_port"]

log = logging.getLogger("plait")

LOCALHOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What to start and where: the arguments of `run` / `run_module`, checked."""

    target: str  # a script path, or a module name when `module` is true
    target_args: tuple[str, ...]
    nproc: int  # ranks on this node
    module: bool = False
    max_restarts: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOCALHOST
    master_port: int | None = None  # None: a free port on one node; required on several

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
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535 (master_port: {self.master_port})")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(
                f"with nnodes={self.nnodes}, every node needs the same --master-addr and --master-port "
                f"(the address and port of node 0); master_port is missing"
            )


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def build_args(spec: LaunchSpec, port: int | None = None) -> list[str]:
    """The `torch.distributed.run` (torchrun) command line for `spec`.

    One node rendezvouses through a c10d store at master_addr:port (`port` defaults to
    spec.master_port, else a free port): no fixed port to collide with. Several nodes use the
    static rendezvous, where each node is told its rank and node 0's address.
    """
    args = [f"--nproc-per-node={spec.nproc}", f"--max-restarts={spec.max_restarts}"]
    if spec.nnodes == 1:
        if port is None:
            port = spec.master_port if spec.master_port is not None else free_port(spec.master_addr)
        args += [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.master_addr}:{port}",
            f"--rdzv-id={uuid.uuid4().hex}",
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


def _threads_per_rank(nproc: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


@contextlib.contextmanager
def _omp_threads(nproc: int) -> Iterator[None]:
    """Set OMP_NUM_THREADS for the children (unless the user did), and restore it afterwards."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(_threads_per_rank(nproc))
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def _exit_code(code: int) -> int:
    """A failed rank's exit code as a shell reports it (a signal N becomes 128 + N)."""
    if code > 0:
        return code
    if code < 0:
        return 128 - code
    return 1  # the rank "failed" with code 0: still a failure of the job


def _launch(spec: LaunchSpec) -> int:
    # Run torchrun in this process rather than as a subprocess: its ChildFailedError tells
    # which ranks failed and how, so the report below is one line per rank instead of
    # torchrun's own traceback. Imported here because it is slow and only `plait run` needs it.
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parsed = torchrun.parse_args(build_args(spec))  # type: ignore[no-untyped-call]  # torch's
    try:
        with _omp_threads(spec.nproc):
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


def run(
    script: str,
    script_args: list[str],
    nproc: int,
    max_restarts: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = LOCALHOST,
    master_port: int | None = None,
) -> int:
    """Run `python script *script_args` on `nproc` local ranks; 0, or the failing rank's exit code."""
    return _launch(LaunchSpec(script, tuple(script_args), nproc, False, max_restarts,
                              nnodes, node_rank, master_addr, master_port))


def run_module(
    module: str,
    module_args: list[str],
    nproc: int,
    max_restarts: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = LOCALHOST,
    master_port: int | None = None,
) -> int:
    """Run `python -m module *module_args` on `nproc` local ranks; like `run`."""
    return _launch(LaunchSpec(module, tuple(module_args), nproc, True, max_restarts,
                              nnodes, node_rank, master_addr, master_port))
