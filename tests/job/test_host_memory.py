"""plait.job.host_memory: CPU ranks keep large freed blocks, so a step's second 64 MB buffer is not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plait.job import host_memory

# Allocates, touches and frees a 64 MB tensor, then counts the page faults of doing it four times more.
PROBE = """
import resource, sys, torch
from plait.job.host_memory import keep_freed_memory
kept = keep_freed_memory()
def touch():
    t = torch.empty(16 * 2**20)
    t.fill_(1.0)
    del t
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    touch()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env: dict[str, str]) -> tuple[bool, int]:
    import os

    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.timeout(240)
def test_a_freed_64_mb_buffer_is_reused_without_faulting_its_pages_in_again(monkeypatch):
    for name in host_memory.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    kept, faults_kept = _faults({})
    # glibc's own default trim threshold set by the user: plait leaves malloc as it is
    left, faults_default = _faults({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert kept and not left
    assert faults_default > 4 * 16_000  # 64 MB of fresh 4 KiB pages, mapped again each time
    # kept: the freed block is reused (a small allocation in its way can make the heap grow once
    # more: 16384 faults in 23 of 30 probes, 0 in the others, against ~65,500 by default)
    assert faults_kept < faults_default / 2


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setattr(host_memory, "_done", False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.keep_freed_memory() is False


GIVE_BACK = PROBE.replace("kept = keep_freed_memory()", "kept = keep_freed_memory()\n"
                          "from plait.job.host_memory import give_back_freed_memory\n"
                          "kept = give_back_freed_memory() and kept")


@pytest.mark.timeout(240)
def test_given_back_a_freed_64_mb_buffer_returns_to_the_system(monkeypatch):
    """zero=3's ranks undo the keeping: each freed 64 MB buffer is unmapped, and faulted in anew."""
    import os

    for name in host_memory.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run([sys.executable, "-c", GIVE_BACK], env=dict(os.environ), check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    assert out[0] == "True" and int(out[1]) > 4 * 16_000, out
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.give_back_freed_memory() is False  # the user's own setting wins
