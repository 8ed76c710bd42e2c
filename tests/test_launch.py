"""Tests for plait.launch and `plait run`: argument building, and real 2-rank launches."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait import launch
from plait.cli import build_parser


def plait_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the `plait` command in a fresh interpreter, as a user would."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=90)


def test_build_args_single_node() -> None:
    spec = launch.LaunchSpec("train.py", ("--lr", "0.1"), nproc=2, max_restarts=1)
    args = launch.build_args(spec, port=12345)
    assert args[:5] == ["--nproc-per-node=2", "--max-restarts=1", "--nnodes=1",
                        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:12345"]
    assert args[5].startswith("--rdzv-id=")
    assert args[6:] == ["train.py", "--lr", "0.1"]


def test_build_args_module_and_free_port() -> None:
    args = launch.build_args(launch.LaunchSpec("plait.demo", ("--epochs", "1"), nproc=3, module=True))
    endpoint = next(a for a in args if a.startswith("--rdzv-endpoint="))
    host, port = endpoint.split("=")[1].split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert args[-4:] == ["--module", "plait.demo", "--epochs", "1"]


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
        ({"nnodes": 2}, "master_port is missing"),
    ],
)
def test_launch_spec_rejects_bad_values(kwargs: dict[str, int], message: str) -> None:
    fields = {"target": "t.py", "target_args": (), "nproc": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        launch.LaunchSpec(**fields)  # type: ignore[arg-type]


def test_cli_run_passes_everything_after_the_script() -> None:
    args = build_parser().parse_args(["run", "-n", "2", "--max-restarts", "1", "train.py", "-n", "5", "--x"])
    assert (args.nproc, args.max_restarts, args.script) == (2, 1, "train.py")
    assert args.script_args == ["-n", "5", "--x"]


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


def test_plait_run_reports_the_failing_rank(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = plait_cli("run", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "rank 1 (local rank 1" in result.stderr and "failed with exit code 3" in result.stderr


def test_plait_run_bad_option_is_a_usage_error(tmp_path: Path) -> None:
    result = plait_cli("run", "-n", "0", "x.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "nproc must be at least 1 (nproc: 0)" in result.stderr
