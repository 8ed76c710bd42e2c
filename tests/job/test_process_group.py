"""Tests for plait.job.process_group, .ranks and .hostlist: every launcher's environment, the
precedence between them, Slurm's list syntax, and real 2-rank groups bootstrapped from each."""

from __future__ import annotations

import datetime
import json
import logging
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from plait.errors import ConfigError
from plait.job.launch import free_port
from plait.runtime import process_group
from plait.job.hostlist import expand_nodelist, expand_tasks_per_node
from plait.job.ranks import RankInfo, derived_port, is_loopback, resolve_ranks
from tests.launching import PROC, clean_env

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

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


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- backend ------------------------------------------------------------------------------------


def test_backend_without_cuda_is_gloo(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setattr(torch.cuda, "is_available", lambda: False)
    assert process_group.choose_backend() == "gloo"


def test_backend_nccl_only_with_a_device_per_local_rank(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setattr(torch.cuda, "is_available", lambda: True)
    no_launcher.setattr(torch.cuda, "device_count", lambda: 2)
    no_launcher.setenv("LOCAL_WORLD_SIZE", "2")
    assert process_group.choose_backend() == "nccl"
    no_launcher.setenv("LOCAL_WORLD_SIZE", "4")
    assert process_group.choose_backend() == "gloo"
    assert process_group.choose_backend(local_world_size=2) == "nccl"


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


def test_world_size_one_is_one_process(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("WORLD_SIZE", "1")
    no_launcher.setenv("RANK", "0")
    assert process_group.init_process_group(timeout_s=5) == (0, 1)
    assert not torch.distributed.is_initialized()


def test_init_logs_the_source(no_launcher: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="plait"):
        assert process_group.init_process_group(timeout_s=5) == (0, 1)
    assert "single process (rank 0 of 1 (local rank 0) from no launcher)" in caplog.text


def test_a_port_in_use_says_to_set_master_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is already in use .* set MASTER_PORT to a free port"):
            process_group.create_store("127.0.0.1", port, True, datetime.timedelta(seconds=5))


# -- Slurm's list syntax ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("a[098-101]", ["a098", "a099", "a100", "a101"]),
        ("rack[1-2]-n[0-1]", ["rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"]),
        ("x-1,y[2]", ["x-1", "y2"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("node[1-2", "unclosed"), ("node[[1]]", "nested"), ("node]1[", "unbalanced"),
    ("node[3-1]", "runs backwards"), ("node[a-b]", "is not a number"), ("a,,b", "empty entry"),
])
def test_expand_nodelist_rejects_malformed_lists(nodelist: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        expand_nodelist(nodelist)


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]


def test_derived_port_is_stable_and_below_the_ephemeral_range() -> None:
    ports = {derived_port(f"openmpi:{job}") for job in range(2000)}
    assert all(20000 <= p < 30000 for p in ports) and len(ports) > 1500
    assert derived_port("slurm:4242.0") == derived_port("slurm:4242.0")


def test_is_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["10.0.0.1", "node0", "0.0.0.0", "::"]))


# -- real groups, bootstrapped from each launcher's environment --------------------------------------

BOOT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from plait.job.process_group import init_process_group
    from tests.launching import listening_addresses

    explicit = json.loads(sys.argv[2])
    rank, world_size = init_process_group(timeout_s=30, **explicit)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    listening = listening_addresses(os.getpid()).get(os.getpid(), [])
    dist.barrier()  # rank 0's store stays up until everyone has read its sockets
    with open(os.path.join(sys.argv[1], "rank%d.json" % rank), "w") as f:
        json.dump({"world_size": world_size, "sum": total.item(), "listening": listening}, f)
    dist.destroy_process_group()
""")


def boot(tmp_path: Path, envs: list[dict[str, str]], explicit: list[dict[str, object]] | None = None) -> list[dict]:
    """Start one process per env (as a launcher would), each joining through init_process_group."""
    script = tmp_path / "boot.py"
    script.write_text(BOOT_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), json.dumps((explicit or [{}] * len(envs))[i])],
                              cwd=root, env=clean_env(PYTHONPATH=str(root), OMP_NUM_THREADS="1", **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, env in enumerate(envs)]
    try:
        errors = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(envs))]


def free_job_id(source: str) -> str:
    """A job id whose derived port is free on 127.0.0.1 right now (tests may run side by side)."""
    for _ in range(50):
        job = str(random.randrange(10**6))
        port = derived_port(f"{source}:{job}.0" if source == "slurm" else f"{source}:{job}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return job
    raise AssertionError("no free derived port in 50 tries")


def fake_launcher(source: str, rank: int, world_size: int, job: str) -> dict[str, str]:
    """What srun or MPICH's mpiexec set for `rank` of `world_size` ranks on one node."""
    if source == "slurm":
        return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(world_size),
                "SLURM_STEP_NUM_TASKS": str(world_size), "SLURM_STEP_ID": "0", "SLURM_JOB_ID": job,
                "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "node1",
                "SLURM_STEP_TASKS_PER_NODE": str(world_size)}
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(world_size), "MPI_LOCALRANKID": str(rank),
            "MPI_LOCALNRANKS": str(world_size), "PMI_JOBID": job}


@pytest.mark.skipif(not (PROC / "net" / "tcp").exists(), reason="reads listening sockets from Linux's /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["slurm", "mpich", "arguments"])
def test_two_ranks_join_from_each_launcher_and_listen_on_loopback_only(tmp_path: Path, source: str) -> None:
    """What srun / mpiexec would set (no srun here: the variables are faked), or explicit arguments
    overriding a contradicting environment: the group forms, and rank 0's store and every gloo
    socket listen on 127.0.0.1 only (torch's own TCPStore would listen on every interface)."""
    if source == "arguments":
        port = free_port()
        envs = [{"WORLD_SIZE": "7", "RANK": "5"}] * 2  # ignored: arguments come first
        explicit: list[dict[str, object]] | None = [
            {"rank": r, "world_size": 2, "master_addr": "127.0.0.1", "master_port": port} for r in (0, 1)]
    else:
        job = free_job_id(source)
        envs, explicit = [fake_launcher(source, r, 2, job) for r in (0, 1)], None
    results = boot(tmp_path, envs, explicit)
    assert [r["world_size"] for r in results] == [2, 2] and [r["sum"] for r in results] == [3.0, 3.0]
    assert len(results[0]["listening"]) >= 2  # rank 0: the store and gloo
    assert all(addr == "127.0.0.1" for r in results for addr, _ in r["listening"]), results


EXIT_SCRIPT = """
import torch
from torch import nn
import plait
torch.manual_seed(0)
model = plait.Model(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
                    plait.Config(layers_per_proc=[2, 1], num_microbatches=2),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
model.train_on_batch(torch.randn(6, 8), torch.randint(0, 2, (6,)))
model.state_dict()  # broadcasts: the last collectives before the interpreter ends
"""


@pytest.mark.timeout(200)
def test_a_clean_run_exits_cleanly(tmp_path: Path) -> None:
    # Regression: a gloo worker still releasing the last collective's tensors when the
    # interpreter finalized aborted the process ("terminate called without an active
    # exception") on 10-30% of such runs. Six launches catch that with high probability.
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    for attempt in range(6):
        result = subprocess.run([sys.executable, "-m", "plait.cli", "run", "-n", "2", str(script)],
                                cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "terminate called" not in result.stderr, (attempt, result.stderr[-2000:])
