"""Two "nodes" on one machine: two `plait run --nnodes 2 --node-rank K` launchers meet at node 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plait.job.launch import free_port
from tests.launching import TRAIN_SCRIPT, clean_env


@pytest.mark.timeout(150)
def test_two_launchers_train_a_two_stage_pipeline_equal_to_one_process(tmp_path: Path) -> None:
    """Each launcher starts one rank; torch's static rendezvous at --master-addr:--master-port gives
    node K's rank the global rank K, and the two ranks train the pipeline as one job."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    port = free_port()
    launchers = [
        subprocess.Popen([sys.executable, "-m", "plait.cli", "run", "--nnodes", "2", "--node-rank", str(node),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), "-n", "1",
                          str(script), str(tmp_path), "2"],
                         cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for node in (1, 0)  # node 1 first: it waits for node 0's store
    ]
    outputs = []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=120)[0])
    finally:
        for launcher in launchers:
            launcher.kill()
    assert all(launcher.returncode == 0 for launcher in launchers), "\n".join(outputs)

    results = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(2)]
    assert [(rank, world) for rank, world, _, _ in results] == [("0", "2"), ("1", "2")]
    for rank, _, diff, loss_diff in results:
        assert float(diff) < 1e-6 and float(loss_diff) < 1e-5, f"rank {rank}: parameters differ by {diff}, losses by {loss_diff}"
    node1, node0 = outputs
    assert "rank 0 of 2 (local rank 0) from torchrun/elastic environment" in node0
    assert "rank 1 of 2 (local rank 0) from torchrun/elastic environment" in node1
