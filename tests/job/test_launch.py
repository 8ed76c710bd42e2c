"""Tests for plait.job.launch and `plait run`: argument building, and real 2-rank launches (the
command line itself: tests/cli/test_main.py)."""

from __future__ import annotations

import subprocess
import sys
import os
import textwrap
from pathlib import Path

import pytest

from plait.job import launch
from tests.launching import PROC, clean_env, listening_addresses, wait_for_files


def plait_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the `plait` command in a fresh interpreter, as a user would."""
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=90)


def test_build_args_single_node_uses_the_loopback_rendezvous() -> None:
    spec = launch.LaunchSpec("train.py", ("--lr", "0.1"), nproc=2, max_restarts=1)
    args = launch.build_args(spec, port=12345)
    assert args[:5] == ["--nproc-per-node=2", "--max-restarts=1", "--nnodes=1",
                        "--rdzv-backend=plait-loopback", "--rdzv-endpoint=127.0.0.1:12345"]
    assert args[5].startswith("--rdzv-id=")
    assert args[6:] == ["--local-addr=127.0.0.1", "train.py", "--lr", "0.1"]


def test_build_args_module_and_any_free_port() -> None:
    args = launch.build_args(launch.LaunchSpec("plait.cli.demo", ("--epochs", "1"), nproc=3, module=True))
    assert "--rdzv-endpoint=127.0.0.1:0" in args  # port 0: the OS picks a free one when binding
    assert args[-4:] == ["--module", "plait.cli.demo", "--epochs", "1"]


def test_build_args_several_nodes_use_static_rendezvous() -> None:
    spec = launch.LaunchSpec("t.py", (), nproc=4, nnodes=2, node_rank=1,
                             master_addr="10.0.0.1", master_port=29400)
    assert launch.build_args(spec) == [
        "--nproc-per-node=4", "--max-restarts=0", "--nnodes=2", "--node-rank=1",
        "--master-addr=10.0.0.1", "--master-port=29400", "t.py",
    ]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nproc": 0}, r"nproc must be at least 1 \(nproc: 0\)"),
        ({"max_restarts": -1}, r"max_restarts: -1"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 1}, r"node_rank must be in 0\.\.1"),
        ({"nnodes": 2}, "missing: --master-addr, --master-port"),
        ({"nnodes": 2, "master_port": 29400}, "missing: --master-addr$"),
        ({"master_port": 70000}, r"master_port must be in 1\.\.65535, or 0 .* \(master_port: 70000\)"),
    ],
)
def test_launch_spec_rejects_bad_values(kwargs: dict[str, int], message: str) -> None:
    fields = {"target": "t.py", "target_args": (), "nproc": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        launch.LaunchSpec(**fields)  # type: ignore[arg-type]


def test_nodes_on_this_machine_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # a loopback master: every node is on this machine, so its cores are shared among all their
    # ranks; a remote master: this node's ranks have its cores to themselves; a user's setting stays
    from plait.job import ranks
    monkeypatch.setattr(ranks, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def threads(**where: object) -> str:
        with launch._child_env(launch.LaunchSpec("t.py", (), 1, nnodes=2, master_port=29500, **where)):
            return os.environ["OMP_NUM_THREADS"]

    assert threads(master_addr="127.0.0.1") == "4"
    assert threads(master_addr="localhost", node_rank=1) == "4"
    assert threads(master_addr="10.0.0.1") == "8"
    assert "OMP_NUM_THREADS" not in os.environ  # restored afterwards
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads(master_addr="127.0.0.1") == "3"


@pytest.mark.timeout(100)
def test_plait_run_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        out = sys.argv[1]
        with open(os.path.join(out, "rank%s.txt" % os.environ["RANK"]), "w") as f:
            f.write("%s %s %s" % (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["OMP_NUM_THREADS"]))
    """))
    result = plait_cli("run", "-n", "2", str(script), str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rank_files = sorted(p.name for p in tmp_path.glob("rank*.txt"))
    assert rank_files == ["rank0.txt", "rank1.txt"]
    rank, world_size, threads = (tmp_path / "rank1.txt").read_text().split()
    assert (rank, world_size) == ("1", "2") and int(threads) >= 1


@pytest.mark.timeout(100)
def test_plait_run_reports_the_failing_rank(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = plait_cli("run", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "rank 1 (local rank 1" in result.stderr and "failed with exit code 3" in result.stderr


@pytest.mark.timeout(60)
def test_plait_run_bad_option_is_a_usage_error(tmp_path: Path) -> None:
    result = plait_cli("run", "-n", "0", "x.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "nproc must be at least 1 (nproc: 0)" in result.stderr


@pytest.mark.timeout(60)
def test_plait_run_several_nodes_without_master_is_a_usage_error(tmp_path: Path) -> None:
    result = plait_cli("run", "--nnodes", "2", "--node-rank", "1", "x.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "missing: --master-addr, --master-port" in result.stderr


HOLD_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from plait.job.process_group import init_process_group

out = sys.argv[1]
rank, world_size = init_process_group(timeout_s=60)
total = torch.ones(1)
dist.all_reduce(total)  # every gloo connection is up
open(os.path.join(out, "ready%d" % rank), "w").write(str(int(total.item())))
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not (PROC / "net" / "tcp").exists(), reason="reads listening sockets from Linux's /proc")
@pytest.mark.timeout(100)
def test_plait_run_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every socket a one-node job listens on, the launcher's stores and each rank's gloo, is on 127.0.0.1.

    torch's own c10d rendezvous would listen on every interface (`*:port`) even with a
    127.0.0.1 endpoint; plait's loopback rendezvous hands torch sockets bound to 127.0.0.1.
    """
    script = tmp_path / "hold.py"
    script.write_text(HOLD_SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "plait.cli", "run", "-n", "2", str(script), str(tmp_path)],
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_files(proc, tmp_path, "ready*", 2, 80, "the ranks came up")
        listening = listening_addresses(proc.pid)
    finally:
        (tmp_path / "go").touch()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert [(tmp_path / f"ready{r}").read_text() for r in (0, 1)] == ["2", "2"]
    # the launcher's two stores (rendezvous, and the ranks' bootstrap) and one gloo socket per rank
    assert sum(len(found) for found in listening.values()) >= 4, listening
    assert len(listening) == 3 and len(listening[proc.pid]) == 2, listening
    exposed = {pid: found for pid, found in listening.items() if any(addr != "127.0.0.1" for addr, _ in found)}
    assert not exposed, f"listening beyond 127.0.0.1: {exposed}"


@pytest.mark.timeout(100)
def test_plait_run_replan_reaches_every_rank_config(tmp_path: Path) -> None:
    script = tmp_path / "replan.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import plait
        from plait.config.run_options import apply_run_options  # what Model applies to its config
        with open(os.path.join(sys.argv[1], "rank%s.txt" % os.environ["RANK"]), "w") as f:
            f.write("%s %s" % (apply_run_options(plait.Config()).replan,
                           apply_run_options(plait.Config(replan=False)).replan))
    """))
    result = plait_cli("run", "-n", "2", "--replan", str(script), str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["True False"] * 2
    result = plait_cli("run", "-n", "1", str(script), str(tmp_path), cwd=tmp_path)  # without: off
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rank0.txt").read_text() == "False False"
