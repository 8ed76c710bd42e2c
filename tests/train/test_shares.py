"""Tests for plait.train.shares: each replica's rows of the global batches `loader_batches` gives,
read alone, in the same order (a shuffled or sequential Dataset or DataLoader, uneven batches,
drop_last, a resumed epoch), and only those rows loaded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from plait import data as batching
from plait.train.shares import share_batches


class Counted(Dataset):  # type: ignore[type-arg]
    """A TensorDataset of 23 rows (x, then y: the row's id) that records each index it loads."""

    def __init__(self) -> None:
        self.x = torch.randn(23, 3, generator=torch.Generator().manual_seed(0))
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded.append(i)
        return self.x[i], torch.tensor(float(i))


def _sources(data: Counted) -> list[tuple[str, Any, int | None]]:
    return [("dataset shuffled", data, 6), ("loader shuffled", DataLoader(data, batch_size=6, shuffle=True), None),
            ("loader in order", DataLoader(data, batch_size=5), None),
            ("loader drop_last", DataLoader(data, batch_size=6, shuffle=True, drop_last=True), None)]


@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("skip", [0, 2])
def test_the_shares_of_every_replica_join_into_the_whole_batches_in_order(dp: int, skip: int) -> None:
    data = Counted()
    for what, source, batch_size in _sources(data):
        whole = list(batching.epoch_batches(source, None, batch_size, True, 7, 1, skip))
        shares = [list(share_batches(source, batch_size, True, batching.epoch_seed(7, 1), skip, r, dp) or [])
                  for r in range(dp)]
        assert all(len(s) == len(whole) for s in shares), (what, [len(s) for s in shares], len(whole))
        for step, (x, y) in enumerate(whole):
            parts = [s[step] for s in shares]
            assert all(p.rows == len(y) for p in parts), what
            assert [p.start for p in parts] == [lo for lo, _ in batching.shard_bounds(len(y), dp)], what
            torch.testing.assert_close(torch.cat([p.x for p in parts]), x, msg=what)
            torch.testing.assert_close(torch.cat([p.y for p in parts]), y, msg=what)


def test_a_replica_loads_only_its_rows_and_nothing_of_skipped_batches() -> None:
    data = Counted()
    shares = list(share_batches(DataLoader(data, batch_size=6, shuffle=True), None, True, 3, 1, 1, 2) or [])
    # batches 2-4 of 6, 6, 5 rows after a skipped first: replica 1 of 2 has 3, 3 and 2 of them
    assert [len(s.y) for s in shares] == [3, 3, 2]
    assert data.loaded == [int(i) for s in shares for i in s.y]


def test_a_batch_of_fewer_rows_than_replicas_leaves_some_without_rows() -> None:
    data = Counted()
    last = [list(share_batches(DataLoader(data, batch_size=11), None, False, 0, 2, r, 3) or []) for r in range(3)]
    # the third batch has 1 row (23 = 11 + 11 + 1): replica 0 reads it, 1 and 2 get none
    assert [len(s) for s in last] == [1, 1, 1] and last[0][0].y.tolist() == [22.0]
    assert last[1][0].x is None and last[1][0].rows == 1 and last[2][0].start == 1


def test_what_cannot_be_split_is_read_whole() -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter([(torch.zeros(3), torch.zeros(()))])

    data = TensorDataset(torch.zeros(8, 3), torch.zeros(8))
    sampler = torch.utils.data.SubsetRandomSampler(range(8))
    assert share_batches(Stream(), 4, False, 0, 0, 0, 2) is None
    assert share_batches(DataLoader(data, batch_size=4, sampler=sampler), None, False, 0, 0, 0, 2) is None
    assert share_batches(torch.zeros(8, 3), 4, False, 0, 0, 0, 2) is None
