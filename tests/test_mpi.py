"""`mpirun -n 4 python train.py`: Open MPI starts the ranks, plait bootstraps gloo from its variables."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import PROC, TRAIN_SCRIPT, clean_env, listening_addresses, wait_for_files

MPIRUN = shutil.which("mpirun")


@pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (Debian: apt-get install openmpi-bin); "
                                           "CI installs it")
@pytest.mark.skipif(not (PROC / "net" / "tcp").exists(), reason="reads listening sockets from Linux's /proc")
@pytest.mark.timeout(180)
def test_mpirun_four_ranks_train_a_four_stage_pipeline_equal_to_one_process(tmp_path: Path) -> None:
    """No torchrun, no mpi4py: the ranks find rank, world size and a store address (127.0.0.1, a port
    from the Open MPI job id) in Open MPI's variables, train equal to one process, log where they
    got it, and listen on 127.0.0.1 only."""
    assert MPIRUN is not None
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = clean_env(OMP_NUM_THREADS="1")
    if os.geteuid() == 0:  # CI runs as root; Open MPI refuses to unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # 4 ranks on 2 cores: --oversubscribe; --bind-to none keeps them off one core each.
    cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-n", "4", sys.executable, str(script), str(tmp_path),
           "4", "hold"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_files(proc, tmp_path, "rank*.txt", 4, 160, "the 4 ranks finished training")
        listening = listening_addresses(proc.pid)
        programs = {pid: (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode() for pid in listening}
    finally:
        (tmp_path / "go").touch()
        try:
            output, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, output

    results = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(4)]
    assert [(rank, world) for rank, world, _, _ in results] == [(str(r), "4") for r in range(4)]
    for rank, _, diff, loss_diff in results:  # state_dict() and the loss are whole on every rank
        assert float(diff) < 1e-6 and float(loss_diff) < 1e-5, f"rank {rank}: parameters differ by {diff}, losses by {loss_diff}"
    for r in range(4):
        assert f"rank {r} of 4 (local rank {r}) from Open MPI (OMPI_COMM_WORLD_*), master 127.0.0.1:" in output
    assert "one node: OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE; port from job id" in output

    # mpirun's own daemon sockets are Open MPI's; the Python ranks' (rank 0's store, gloo) are plait's.
    ranks = {pid: found for pid, found in listening.items() if programs[pid] == sys.executable}
    assert sum(len(found) for found in ranks.values()) >= 5, listening  # the store + a gloo socket per rank
    exposed = {pid: found for pid, found in ranks.items() if any(addr != "127.0.0.1" for addr, _ in found)}
    assert not exposed, f"ranks listening beyond 127.0.0.1: {exposed}"
