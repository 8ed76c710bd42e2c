"""Tests for benchmarks/live_bytes.py: new storages counted until freed, inputs written or viewed not."""

from __future__ import annotations

import torch

from benchmarks.live_bytes import LiveBytes


def test_the_peak_counts_new_storage_until_it_is_freed() -> None:
    before = torch.zeros(100)  # made before: not counted, nor when written in place or viewed
    with LiveBytes() as live:
        a = torch.zeros(1000)  # 4000 bytes
        b = a + 1  # 4000 more
        before.add_(1)
        view = a.view(10, 100)
        del a
        assert (live.live, live.peak) == (8000, 8000)  # the view keeps a's storage alive
        del view
        assert (live.live, live.peak) == (4000, 8000)
        c = b * 2  # a is gone: 8000 live again, no more
        assert (live.live, live.peak) == (8000, 8000)
        del b, c
    assert live.live == 0 and live.peak == 8000
