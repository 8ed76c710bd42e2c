"""`plait device`: a GPU measured into a device file that `plait plan --device` takes, and its errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from plait.cli.main import main
from plait.cost.devices import device
from plait.cli import gpu_probe

GPT = ("--gpt", "layers=24,hidden=2304,heads=24,seq=2048,vocab=51200", "--batch", "512", "--devices", "32")


def test_the_written_file_is_the_measured_device_and_plans(monkeypatch, tmp_path, capsys):
    def measured(like, runs, reps):  # a GPU with a slower matmul than the preset's and a measured layer norm
        assert (like.name, runs, reps) == ("a100-80gb", 2, 5)
        return replace(like, name="NVIDIA A100-SXM4-80GB (like a100-80gb)", gemm_flops=250e12,
                       norm_bandwidth=(1.2e12, 0.6e12))

    monkeypatch.setattr(gpu_probe, "measure_device", measured)
    path = tmp_path / "mine.json"
    assert main(["device", "--like", "a100-80gb", "-o", str(path), "--runs", "2", "--reps", "5"]) == 0
    out = capsys.readouterr().out
    assert "271.2 TFLOP/s at (1024, 10240, 5120)" in out and "250.0 TFLOP/s at (1024, 10240, 5120)" in out
    assert "none (copy)" in out and "1.20 / 0.60 TB/s" in out and f"wrote {path}" in out
    mine = device(str(path))
    assert (mine.gemm_flops, mine.norm_bandwidth) == (250e12, (1.2e12, 0.6e12))
    assert main(["plan", *GPT, "--device", "a100-80gb", "--json"]) == 0
    preset = json.loads(capsys.readouterr().out)
    assert main(["plan", *GPT, "--device", str(path), "--json"]) == 0
    slower = json.loads(capsys.readouterr().out)
    assert slower["predicted_step_time_s"] > preset["predicted_step_time_s"]  # its own figures priced


def test_without_a_gpu_or_with_a_cpu_preset_it_says_what_to_do(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["device", "--like", "h100-80gb", "-o", str(tmp_path / "x.json")]) == 1
    assert "no CUDA device is visible here" in capsys.readouterr().err
    assert main(["device", "--like", "cpu", "-o", str(tmp_path / "x.json")]) == 1
    assert "pick a100-80gb" in capsys.readouterr().err
    assert main(["device", "--like", "rtx-4090", "-o", str(tmp_path / "x.json")]) == 1
    assert "unknown device 'rtx-4090'" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):
        main(["device", "-o", str(tmp_path / "x.json")])  # --like is required
