"""Tests for plait.cli.main: the `plait` command line parsed, and `plait export` run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.checkpoint import disk
from plait.cli.main import build_parser, main


def test_cli_run_passes_everything_after_the_script() -> None:
    args = build_parser().parse_args(["run", "-n", "2", "--max-restarts", "1", "train.py", "-n", "5", "--x"])
    assert (args.nproc, args.max_restarts, args.script) == (2, 1, "train.py")
    assert args.script_args == ["-n", "5", "--x"]


def test_cli_several_nodes() -> None:
    args = build_parser().parse_args(["run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0",
                                      "--master-port", "29400", "-n", "4", "t.py"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc) == (2, 1, "node0", 29400, 4)


def test_run_takes_a_module_with_m() -> None:
    args = build_parser().parse_args(["run", "-m", "plait.cli.demo", "--epochs", "1"])
    assert (args.module, args.script, args.script_args, args.nproc) == (True, "plait.cli.demo", ["--epochs", "1"], 1)
    assert build_parser().parse_args(["demo"]).nproc == 2  # the demo's own default


def test_plait_export_of_a_directory_without_checkpoints_is_an_error(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path), "-o", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert f"plait export: error: {tmp_path} holds no complete plait checkpoint" in err
    assert not (tmp_path / "m.pt").exists()


def test_plait_export_writes_the_model_and_says_which_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    temp = disk.temp_dir(tmp_path, 5, "t0")
    size, digest = disk.write_shard(temp, 0, {"w": torch.arange(3.0)}, {})
    meta = {"step": 5, "state_keys": ["w"], "aliases": {}, "tensors": {"w": {"shard": 0}}, "plan": None,
            "shards": [{"file": "rank0.safetensors", "bytes": size, "sha256": digest}]}
    final = disk.commit(tmp_path, temp, 5, meta, 2)
    out = tmp_path / "m.pt"
    assert main(["export", str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}: the model of step 5 ({final})\n"
    assert torch.load(out, weights_only=True)["w"].tolist() == [0.0, 1.0, 2.0]


def test_export_with_an_unknown_option_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path), "-o", str(tmp_path / "m.pt"), "--fast"])
    assert info.value.code == 2
    assert "unrecognized arguments: --fast" in capsys.readouterr().err
