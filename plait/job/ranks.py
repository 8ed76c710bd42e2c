"""Which launcher started this process, and the rank, world size and master address it implies.

`resolve_ranks` is a pure function of the environment (a mapping) and explicit arguments; it
neither opens sockets nor imports torch.distributed, so every launcher is tested with a fake
environment. The first source that is present wins:

    source     rank, world size, local rank        master address : port
    ---------  ----------------------------------  ------------------------------------------------
    arguments  rank=, world_size=, local_rank=     master_addr= or MASTER_ADDR or 127.0.0.1 :
                                                   master_port= or MASTER_PORT
    torchrun   RANK, WORLD_SIZE, LOCAL_RANK        MASTER_ADDR : MASTER_PORT
    slurm      SLURM_PROCID, SLURM_STEP_NUM_TASKS  one node: 127.0.0.1, else the step's first host :
               (or SLURM_NTASKS), SLURM_LOCALID;   a port from the job and step ids
               only inside an srun step
    openmpi    OMPI_COMM_WORLD_RANK, _SIZE,        one node (LOCAL_SIZE == SIZE): 127.0.0.1, else
               _LOCAL_RANK                         MASTER_ADDR or mpi4py : a port from the job id
    mpich      PMI_RANK, PMI_SIZE, MPI_LOCALRANKID like openmpi, with MPI_LOCALNRANKS or
               (or PMI_LOCAL_RANK)                 PMI_LOCAL_SIZE, and PMI_JOBID
    single     nothing of the above                none: one process, no group

MASTER_ADDR and MASTER_PORT, when set, override the derived address and port for every source.
A derived port lies in 20000..29999, below Linux's default ephemeral range (32768..60999), so
no outgoing connection can be holding it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import zlib
from typing import Callable, Mapping

from plait.errors import ConfigError
from plait.host import local_world_size, usable_cores
from plait.job.hostlist import expand_nodelist, expand_tasks_per_node

__all__ = ["RankInfo", "resolve_ranks", "derived_port", "is_loopback", "SOURCES", "local_world_size",
           "threads_per_rank"]

SOURCES = ("arguments", "torchrun", "slurm", "openmpi", "mpich", "single")
SOURCE_NAMES = {
    "arguments": "explicit arguments",
    "torchrun": "torchrun/elastic environment (RANK, WORLD_SIZE)",
    "slurm": "Slurm (SLURM_PROCID, SLURM_NTASKS)",
    "openmpi": "Open MPI (OMPI_COMM_WORLD_*)",
    "mpich": "MPICH/PMI (PMI_RANK, PMI_SIZE)",
    "single": "no launcher",
}
LOOPBACK = "127.0.0.1"
PORT_BASE, PORT_SPAN = 20000, 10000

# Asked of the MPI launcher when the environment cannot say where rank 0 is: returns rank 0's
# (address, port) on every rank. process_group passes one built on mpi4py when it is importable.
Agree = Callable[[], tuple[str, int]]


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Where this process stands in the job, and how it was found out."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # None: the launcher does not say
    master_addr: str | None  # None only for one process
    master_port: int | None
    source: str  # one of SOURCES
    origin: str = ""  # how master_addr:master_port were chosen, for the log
    passed_over: tuple[str, ...] = ()  # launchers present but not used, and why

    def __post_init__(self) -> None:
        assert self.source in SOURCES, self.source
        name = SOURCE_NAMES[self.source]
        if self.world_size < 1:
            raise ConfigError(f"world size must be at least 1 (world size: {self.world_size}, from {name})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank {self.rank} is outside 0..{self.world_size - 1} (world size {self.world_size}, "
                f"from {name}); every rank must be started by the same launcher"
            )
        if self.world_size > 1 and (self.master_addr is None or self.master_port is None):
            raise ConfigError(f"rank {self.rank} of {self.world_size} has no master address:port (from {name})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master port must be in 1..65535 (master port: {self.master_port}, from {name})")

    @property
    def loopback(self) -> bool:
        """Every rank is on this machine (the master is a loopback address): bind 127.0.0.1 only."""
        return self.master_addr is not None and is_loopback(self.master_addr)

    def describe(self) -> str:
        where = "" if self.master_addr is None else f", master {self.master_addr}:{self.master_port}"
        origin = f" ({self.origin})" if self.origin else ""
        skipped = "".join(f"; {note}" for note in self.passed_over)
        return (f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}) "
                f"from {SOURCE_NAMES[self.source]}{where}{origin}{skipped}")


def threads_per_rank(local_ranks: int) -> int:
    """This machine's cores shared by `local_ranks` processes (what `plait run` gives each)."""
    return max(1, usable_cores() // max(1, local_ranks))


def is_loopback(host: str) -> bool:
    """True for "localhost" and 127.0.0.0/8 or ::1; a host name is not resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def derived_port(key: str) -> int:
    """A port every rank computes alike from a job's id (CRC-32, so stable across processes)."""
    return PORT_BASE + zlib.crc32(key.encode()) % PORT_SPAN


# -- reading the environment ------------------------------------------------------------------


class _Env:
    """Typed reads of one environment mapping, with errors naming the variable and its value."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def text(self, *names: str) -> str | None:
        """The first of `names` that is set and not empty."""
        return next((self.env[n] for n in names if self.env.get(n, "") != ""), None)

    def number(self, *names: str) -> int | None:
        for name in names:
            value = self.env.get(name, "")
            if value != "":
                try:
                    return int(value)
                except ValueError:
                    raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
        return None

    def has(self, *names: str) -> bool:
        return self.text(*names) is not None


def _master(env: _Env) -> tuple[str | None, int | None, list[str]]:
    """MASTER_ADDR and MASTER_PORT when set, with a note on each for the log."""
    addr, port = env.text("MASTER_ADDR"), env.number("MASTER_PORT")
    notes = (["MASTER_ADDR"] if addr else []) + (["MASTER_PORT"] if port is not None else [])
    return addr, port, notes


def _from_arguments(env: _Env, rank: int, world_size: int, local_rank: int | None,
                    master_addr: str | None, master_port: int | None) -> RankInfo:
    addr = master_addr or env.text("MASTER_ADDR") or LOOPBACK
    port = master_port if master_port is not None else env.number("MASTER_PORT")
    if world_size > 1 and port is None:
        raise ConfigError(
            f"rank={rank}, world_size={world_size} were given but no master port: pass "
            f"master_port=P (the same free port on every rank) or set MASTER_PORT"
        )
    if local_rank is None:
        local_rank = env.number("LOCAL_RANK")
    if local_rank is None:
        local_rank = rank if is_loopback(addr) else 0
    local_size = env.number("LOCAL_WORLD_SIZE") or (world_size if is_loopback(addr) else None)
    return RankInfo(rank, world_size, local_rank, local_size, _canonical(addr) if world_size > 1 else None,
                    port if world_size > 1 else None, "arguments", "given" if world_size > 1 else "")


def _canonical(addr: str) -> str:
    # "localhost" may resolve to ::1 on one rank and 127.0.0.1 on another; name one address.
    return LOOPBACK if addr == "localhost" else addr


def _from_torchrun(env: _Env) -> RankInfo:
    world_size = env.number("WORLD_SIZE")
    assert world_size is not None
    rank = env.number("RANK")
    if world_size <= 1:
        return RankInfo(rank or 0, max(world_size, 1), 0, 1, None, None, "torchrun")
    missing = [n for n in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.has(n)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world_size} is set but {', '.join(missing)} is not; start every rank with "
            f"`plait run -n N script.py`, torchrun, srun or mpirun, or unset WORLD_SIZE"
        )
    assert rank is not None
    addr = env.text("MASTER_ADDR")
    assert addr is not None
    return RankInfo(rank, world_size, env.number("LOCAL_RANK") or 0, env.number("LOCAL_WORLD_SIZE"),
                    _canonical(addr), env.number("MASTER_PORT"), "torchrun", "MASTER_ADDR, MASTER_PORT")


def _slurm_world(env: _Env) -> tuple[int, int] | None:
    """(rank, world size) when this process is a task of an srun step, else None."""
    # SLURM_STEP_ID is set by srun only: a batch script or an salloc shell also carries
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS, and must not wait for tasks never started.
    if not (env.has("SLURM_PROCID") and env.has("SLURM_STEP_ID", "SLURM_STEPID")):
        return None
    size = env.number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    rank = env.number("SLURM_PROCID")
    if size is None or rank is None:
        return None
    return rank, size


def _from_slurm(env: _Env) -> RankInfo:
    world = _slurm_world(env)
    assert world is not None
    rank, world_size = world
    local_rank = env.number("SLURM_LOCALID") or 0
    nodes = env.number("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    local_size: int | None = None
    per_node = env.text("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if per_node is not None:
        counts = expand_tasks_per_node(per_node)
        node_id = env.number("SLURM_NODEID") or 0
        local_size = counts[node_id] if node_id < len(counts) else None
    if world_size == 1:
        return RankInfo(0, 1, 0, 1, None, None, "slurm")
    addr, port, notes = _master(env)
    origin = []
    if addr is None:
        if nodes == 1 or (nodes is None and local_size == world_size):
            addr = LOOPBACK
            origin.append("one node")
        else:
            nodelist = env.text("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if nodelist is None:
                raise ConfigError(
                    "Slurm sets no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): set MASTER_ADDR "
                    "to the host of task 0, e.g. `export MASTER_ADDR=$(hostname)` before srun"
                )
            addr = expand_nodelist(nodelist)[0]
            origin.append(f"first host of {nodelist}")
    if port is None:
        job = env.text("SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            raise ConfigError(
                "Slurm sets no SLURM_JOB_ID to derive a port from: set MASTER_PORT (the same on every task)"
            )
        step = env.text("SLURM_STEP_ID", "SLURM_STEPID") or "0"
        port = derived_port(f"slurm:{job}.{step}")
        origin.append(f"port from job {job} step {step}")
    return RankInfo(rank, world_size, local_rank, local_size, _canonical(addr), port, "slurm",
                    "; ".join(notes + origin))


# (rank, size, local rank, local size, job id) variables of each MPI launcher, and its flag
# for passing a variable to every rank.
_MPI_VARS = {
    "openmpi": (("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
                ("OMPI_COMM_WORLD_LOCAL_SIZE",),
                ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"),
                "mpirun -x {name}={value}"),
    "mpich": (("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
              ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
              ("PMI_JOBID", "I_MPI_HYDRA_UUID", "PMIX_NAMESPACE"),
              "mpiexec -genv {name} {value}"),
}


def _mpi_world(env: _Env, source: str) -> tuple[int, int] | None:
    rank_vars, size_vars = _MPI_VARS[source][:2]
    rank, size = env.number(*rank_vars), env.number(*size_vars)
    return None if rank is None or size is None else (rank, size)


def _from_mpi(env: _Env, source: str, agree: Agree | None) -> RankInfo:
    rank_vars, size_vars, local_vars, local_size_vars, job_vars, flag = _MPI_VARS[source]
    world = _mpi_world(env, source)
    assert world is not None
    rank, world_size = world
    local_rank = env.number(*local_vars)
    local_size = env.number(*local_size_vars)
    if world_size == 1:
        return RankInfo(0, 1, 0, 1, None, None, source)
    addr, port, notes = _master(env)
    origin = list(notes)
    one_node = local_size == world_size
    if addr is None and one_node:
        addr = LOOPBACK
        origin.append(f"one node: {local_size_vars[0]} == {size_vars[0]}")
    job_key = env.text(*job_vars)
    if port is None and job_key is not None:
        port = derived_port(f"{source}:{job_key}")
        origin.append(f"port from job id {job_key}")
    if (addr is None or port is None) and agree is not None:
        agreed_addr, agreed_port = agree()
        asked = (["rank 0's host name"] if addr is None else []) + (["a free port"] if port is None else [])
        addr = addr or agreed_addr
        port = port if port is not None else agreed_port
        origin.append(f"{' and '.join(asked)} through mpi4py")
    if addr is None:
        where = f"{local_size_vars[0]}={local_size}" if local_size is not None else f"no {local_size_vars[0]}"
        raise ConfigError(
            f"the {world_size} ranks may span several nodes ({size_vars[0]}={world_size}, {where}) and "
            f"MASTER_ADDR is not set: pass the address of the node running rank 0 to every rank, "
            f"e.g. `{flag.format(name='MASTER_ADDR', value='host0')} ...`, or install mpi4py"
        )
    if port is None:
        raise ConfigError(
            f"no job id in the environment ({', '.join(job_vars)}) to derive a port from: set the same "
            f"free port on every rank, e.g. `{flag.format(name='MASTER_PORT', value='29500')} ...`"
        )
    return RankInfo(rank, world_size, local_rank if local_rank is not None else 0, local_size,
                    _canonical(addr), port, source, "; ".join(origin))


def resolve_ranks(
    env: Mapping[str, str],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    agree: Agree | None = None,
) -> RankInfo:
    """This process's place in the job, from the first source present (the module docstring's table).

    `agree` is asked for rank 0's address and a port only by an MPI source that cannot derive
    them (several nodes and no MASTER_ADDR).
    """
    e = _Env(env)
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ConfigError(
                f"explicit ranks need both rank and world_size (rank: {rank}, world_size: {world_size})"
            )
        return _from_arguments(e, rank, world_size, local_rank, master_addr, master_port)
    if e.has("WORLD_SIZE"):
        return _from_torchrun(e)

    notes: list[str] = []

    slurm = _slurm_world(e)
    mpi = next(((s, w) for s in ("openmpi", "mpich") if (w := _mpi_world(e, s)) is not None), None)
    if slurm is not None:
        if mpi is None or mpi[1] == slurm:
            return _from_slurm(e)
        # mpirun run inside an allocation starts its daemons with srun: the SLURM_* variables
        # then describe a daemon, and the MPI launcher's describe this rank.
        notes.append(f"Slurm's rank/size {slurm} describe mpirun's daemon, not this rank "
                     f"({SOURCE_NAMES[mpi[0]]} says {mpi[1]}): using {mpi[0]}")
    elif e.has("SLURM_PROCID") and e.number("SLURM_NTASKS", "SLURM_NPROCS") not in (None, 1):
        notes.append("inside a Slurm allocation but not in an srun step (no SLURM_STEP_ID): "
                     "Slurm's variables are ignored; start the ranks with srun")
    info = _from_mpi(e, mpi[0], agree) if mpi is not None else RankInfo(0, 1, 0, 1, None, None, "single")
    return dataclasses.replace(info, passed_over=tuple(notes))
