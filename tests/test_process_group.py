"""Tests for plait.runtime.process_group: backend choice and the single-process case."""

from __future__ import annotations

import pytest
import torch

from plait.runtime import process_group

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


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


def test_no_launcher_is_one_process(no_launcher: pytest.MonkeyPatch) -> None:
    assert process_group.init_process_group(timeout_s=5) == (0, 1)
    assert not torch.distributed.is_initialized()


def test_world_size_one_is_one_process(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("WORLD_SIZE", "1")
    no_launcher.setenv("RANK", "0")
    assert process_group.init_process_group(timeout_s=5) == (0, 1)
    assert not torch.distributed.is_initialized()


def test_incomplete_launcher_env_says_what_is_missing(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("WORLD_SIZE", "2")
    no_launcher.setenv("RANK", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT is not; start every rank with `plait run"):
        process_group.init_process_group(timeout_s=5)


def test_rank_out_of_range(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("WORLD_SIZE", "2")
    no_launcher.setenv("RANK", "2")
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"RANK=2 is outside 0\.\.1"):
        process_group.init_process_group(timeout_s=5)
