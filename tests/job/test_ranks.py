"""Tests for plait.job.ranks: every launcher's environment, the precedence between them, the
ports derived from a job id, and errors naming the variable to fix."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.job.ranks import RankInfo, derived_port, is_loopback, resolve_ranks

# What each launcher sets for rank 1 of 4 on one node (a subset of what each really exports).
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1",
         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu[07-08]",
         "SLURM_STEP_NODELIST": "gpu07"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_MCA_ess_base_jobid": "1593573377",
           "PMIX_NAMESPACE": "1593573377"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "PMI_JOBID": "77"}


# -- one launcher at a time -----------------------------------------------------------------------


def test_no_launcher_is_one_process() -> None:
    assert resolve_ranks({}) == RankInfo(0, 1, 0, 1, None, None, "single")


def test_torchrun() -> None:
    info = resolve_ranks(TORCHRUN)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "torchrun", 1, 4, 1, 4)
    assert (info.master_addr, info.master_port, info.loopback) == ("127.0.0.1", 29500, True)


def test_slurm_one_node_is_loopback_with_a_port_from_the_job() -> None:
    info = resolve_ranks(SLURM)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "slurm", 1, 4, 1, 4)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", derived_port("slurm:4242.0"))
    assert "one node" in info.origin and "job 4242 step 0" in info.origin


def test_slurm_several_nodes_use_the_first_host_of_the_step() -> None:
    env = {**SLURM, "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "0"}
    info = resolve_ranks(env)
    assert (info.rank, info.local_rank, info.local_world_size) == (3, 0, 1)
    assert (info.master_addr, info.loopback) == ("gpu07", False)
    assert "first host of gpu[07-08]" in info.origin


def test_slurm_step_size_beats_the_allocation_size() -> None:
    """`srun -n 2` inside an allocation of 8 tasks: the step's 2 tasks are the world."""
    info = resolve_ranks({**SLURM, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"})
    assert info.world_size == 2


def test_slurm_allocation_without_srun_is_not_a_job_of_many() -> None:
    """A batch script (or an salloc shell) carries SLURM_PROCID=0 and SLURM_NTASKS=4 but no step."""
    env = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    info = resolve_ranks({**env, "SLURM_PROCID": "0"})
    assert (info.source, info.world_size) == ("single", 1)
    assert "not in an srun step" in info.passed_over[0]


def test_master_addr_and_port_override_what_is_derived() -> None:
    info = resolve_ranks({**OPENMPI, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29600"})
    assert (info.master_addr, info.master_port, info.loopback) == ("10.1.2.3", 29600, False)
    info = resolve_ranks({**SLURM, "MASTER_PORT": "29601"})
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 29601)


def test_openmpi_one_node() -> None:
    info = resolve_ranks(OPENMPI)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "openmpi", 1, 4, 1, 4)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", derived_port("openmpi:1593573377"))


def test_openmpi_5_has_only_the_pmix_namespace() -> None:
    env = {k: v for k, v in OPENMPI.items() if k != "OMPI_MCA_ess_base_jobid"}
    info = resolve_ranks({**env, "PMIX_NAMESPACE": "prterun-node0-5123@1"})
    assert info.master_port == derived_port("openmpi:prterun-node0-5123@1")


def test_openmpi_several_nodes_needs_master_addr() -> None:
    env = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ConfigError, match=r"OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_SIZE=2\) and "
                                          r"MASTER_ADDR is not set.*`mpirun -x MASTER_ADDR=host0 \.\.\.`"):
        resolve_ranks(env)
    info = resolve_ranks({**env, "MASTER_ADDR": "node0"})
    assert (info.master_addr, info.master_port) == ("node0", derived_port("openmpi:1593573377"))


def test_openmpi_several_nodes_asks_mpi_when_it_can() -> None:
    """With mpi4py importable, process_group passes `agree`: rank 0's host and a free port."""
    info = resolve_ranks({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, agree=lambda: ("node0", 31000))
    assert (info.master_addr, info.master_port) == ("node0", derived_port("openmpi:1593573377"))
    assert "rank 0's host name through mpi4py" in info.origin
    no_job = {k: v for k, v in OPENMPI.items() if k not in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")}
    info = resolve_ranks({**no_job, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, agree=lambda: ("node0", 31000))
    assert (info.master_addr, info.master_port) == ("node0", 31000)


def test_mpi_without_a_job_id_needs_master_port() -> None:
    env = {k: v for k, v in MPICH.items() if k != "PMI_JOBID"}
    with pytest.raises(ConfigError, match=r"no job id .*PMI_JOBID.*`mpiexec -genv MASTER_PORT 29500 \.\.\.`"):
        resolve_ranks(env)
    assert resolve_ranks({**env, "MASTER_PORT": "29700"}).master_port == 29700


def test_mpich_and_cray_pmi() -> None:
    info = resolve_ranks(MPICH)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "mpich", 1, 4, 1, 4)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", derived_port("mpich:77"))
    cray = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4", "PMI_JOBID": "9"}
    with pytest.raises(ConfigError, match="MPI_LOCALNRANKS=4"):
        resolve_ranks(cray)  # two nodes of 4: where rank 0 runs must be told
    info = resolve_ranks({**cray, "MASTER_ADDR": "nid0001"})
    assert (info.rank, info.local_rank, info.local_world_size, info.master_addr) == (5, 1, 4, "nid0001")


def test_explicit_arguments() -> None:
    info = resolve_ranks({}, rank=1, world_size=2, master_port=29800)
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("arguments", 1, 2, 1)
    assert (info.master_addr, info.master_port, info.loopback) == ("127.0.0.1", 29800, True)
    info = resolve_ranks({}, rank=0, world_size=2, master_addr="localhost", master_port=1)
    assert info.master_addr == "127.0.0.1"  # one name for every rank: localhost may resolve to ::1
    with pytest.raises(ConfigError, match=r"need both rank and world_size \(rank: 1, world_size: None\)"):
        resolve_ranks({}, rank=1)
    with pytest.raises(ConfigError, match="no master port: pass master_port=P"):
        resolve_ranks({}, rank=1, world_size=2)


# -- precedence: explicit arguments > torchrun > Slurm > Open MPI > MPICH > one process ----------


@pytest.mark.parametrize(
    "present, expected",
    [
        ([TORCHRUN, SLURM, OPENMPI, MPICH], "torchrun"),  # e.g. `srun torchrun ...`
        ([SLURM, MPICH], "slurm"),  # `srun --mpi=pmi2`: both say the same
        ([OPENMPI, MPICH], "openmpi"),
        ([MPICH], "mpich"),
        ([], "single"),
    ],
)
def test_precedence(present: list[dict[str, str]], expected: str) -> None:
    env = {k: v for source in present for k, v in source.items()}
    assert resolve_ranks(env).source == expected
    assert resolve_ranks(env, rank=0, world_size=1).source == "arguments"


def test_mpirun_inside_a_slurm_allocation_uses_the_mpi_ranks() -> None:
    """mpirun starts its daemons with srun, one per node: SLURM_* then describe a daemon."""
    daemon = {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}
    info = resolve_ranks({**daemon, **OPENMPI})
    assert (info.source, info.rank, info.world_size) == ("openmpi", 1, 4)
    assert "describe mpirun's daemon" in info.passed_over[0]


# -- bad values -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "2", "RANK": "1"}, "WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT is not; start every rank"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"rank 2 is outside 0\.\.1"),
        ({"WORLD_SIZE": "two"}, r"WORLD_SIZE='two' is not an integer"),
        ({**OPENMPI, "OMPI_COMM_WORLD_RANK": "4"}, r"rank 4 is outside 0\.\.3 .*Open MPI"),
        ({**OPENMPI, "MASTER_PORT": "70000"}, r"master port must be in 1\.\.65535 \(master port: 70000"),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4(3)"}, r"tasks per node '4\(3\)'"),
    ],
)
def test_bad_environment_says_which_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_ranks(env)


def test_derived_port_is_stable_and_below_the_ephemeral_range() -> None:
    ports = {derived_port(f"openmpi:{job}") for job in range(2000)}
    assert all(20000 <= p < 30000 for p in ports) and len(ports) > 1500
    assert derived_port("slurm:4242.0") == derived_port("slurm:4242.0")


def test_is_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["10.0.0.1", "node0", "0.0.0.0", "::"]))
