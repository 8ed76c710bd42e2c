"""Tests for plait.job.process_group: the backend, the store, and real 2-rank groups bootstrapped
from each launcher's environment (the environments themselves: tests/job/test_ranks.py)."""

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
from plait.job import process_group
from plait.job.launch import free_port
from plait.job.ranks import derived_port
from tests.launching import PROC, clean_env

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
    root = Path(__file__).resolve().parents[2]
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
                    plait.Config(layers_per_stage=[2, 1], num_microbatches=2),
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
