"""plait.data: the epoch's global batches, their count, and the joining of outputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import plait
from plait import data
from plait.errors import PlaitError


def rows(n=10):
    return torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n)


def test_count_batches_rounds_up_for_tensors_datasets_and_loaders():
    x, y = rows(10)
    assert data.count_batches(x, 4) == 3
    assert data.count_batches(x, None) == 1  # the whole set in one batch
    assert data.count_batches(TensorDataset(x, y), 3) == 4
    assert data.count_batches(DataLoader(TensorDataset(x, y), batch_size=5), None) == 2
    with pytest.raises(plait.ConfigError, match="needs batch_size"):
        data.count_batches(TensorDataset(x, y), None)
    with pytest.raises(plait.ConfigError, match="x has 0 rows"):
        data.count_batches(x[:0], 4)
    for bad in (0, -2, 2.5, True):  # 0 once passed as "the whole set"
        with pytest.raises(plait.ConfigError, match=rf"batch_size must be a positive integer.*got {bad!r}"):
            data.count_batches(x, bad)


def test_epoch_batches_cover_the_epoch_once_in_an_order_fixed_by_seed_and_epoch():
    x, y = rows(10)
    first = [yb.tolist() for _, yb in data.epoch_batches(x, y, 4, True, seed=3, epoch=1)]
    assert sorted(sum(first, [])) == list(range(10)) and [len(b) for b in first] == [4, 4, 2]
    assert first == [yb.tolist() for _, yb in data.epoch_batches(x, y, 4, True, seed=3, epoch=1)]
    assert first != [yb.tolist() for _, yb in data.epoch_batches(x, y, 4, True, seed=3, epoch=2)]
    resumed = [yb.tolist() for _, yb in data.epoch_batches(x, y, 4, True, seed=3, epoch=1, skip=1)]
    assert resumed == first[1:]  # a resumed epoch skips the batches done, same order
    for xb, yb in data.epoch_batches(x, y, 4, True, seed=3, epoch=1):
        assert torch.equal(xb.squeeze(1).long(), yb)  # rows stay paired with their targets
    plain = [yb.tolist() for _, yb in data.epoch_batches(x, y, 4, False, seed=3, epoch=1)]
    assert plain == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_epoch_batches_name_bad_targets():
    x, y = rows(10)
    with pytest.raises(plait.ConfigError, match="targets y are missing"):
        next(data.epoch_batches(x, None, 4, False, 0, 0))
    with pytest.raises(plait.ConfigError, match="x has 10 rows but y has 9"):
        next(data.epoch_batches(x, y[:9], 4, False, 0, 0))


def test_data_order_records_what_fixes_the_order():
    x, _ = rows(10)
    y = torch.arange(10)
    assert data.data_order(x, y, 4, True, 3, seed=7) == {
        "seed": 7, "shuffle": True, "batch_size": 4, "rows": 10, "batches_per_epoch": 3,
        "data_fingerprint": data.fingerprint(x, y)}
    loader = data.data_order(TensorDataset(x), None, 4, False, 3, seed=7)
    assert loader["rows"] is None and loader["data_fingerprint"] is None  # a Dataset is not read twice


def test_the_fingerprint_follows_the_values_shapes_and_dtypes_of_x_and_y():
    x, y = torch.arange(200.0).reshape(100, 2), torch.arange(100)
    same = data.fingerprint(x.clone(), y.clone())
    assert data.fingerprint(x, y) == same and len(same) == 16
    edited = x.clone()
    edited[99, 1] += 1  # the last row is always among the rows hashed
    assert data.fingerprint(edited, y) != same
    assert data.fingerprint(x, y + 1) != same
    assert data.fingerprint(x.double(), y) != same
    assert data.fingerprint(x[:99], y[:99]) != same
    assert data.fingerprint({"a": x}, y) != data.fingerprint({"b": x}, y)  # the structure counts


def test_join_rows_concatenates_tensors_along_rows_and_keeps_the_first_of_other_leaves():
    joined = data.join_rows([[torch.ones(2, 3), torch.tensor(1.0), "a"], [torch.zeros(1, 3), torch.tensor(2.0), "b"]])
    assert joined[0].shape == (3, 3) and torch.equal(joined[0][2], torch.zeros(3))
    assert float(joined[1]) == 1.0 and joined[2] == "a"


def test_row_ranges_cut_x_in_order_and_check_batch_size():
    x, _ = rows(10)
    assert data.row_ranges(x, 4) == [(0, 4), (4, 8), (8, 10)]
    assert data.row_ranges(x, None) == [(0, 10)]
    with pytest.raises(plait.ConfigError, match="batch_size must be a positive integer.*got 0"):
        data.row_ranges(x, 0)


def test_batch_sizes_are_the_full_one_and_an_uneven_last_one_where_the_data_tells() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from plait.data import batch_sizes

    x = torch.zeros(10, 3)
    assert batch_sizes(x, 4) == (4, 2) and batch_sizes(x, 5) == (5,) and batch_sizes(x, None) == (10,)
    assert batch_sizes(x, 16) == (10,)  # one batch of every row
    data = TensorDataset(x, torch.zeros(10))
    assert batch_sizes(data, 4) == (4, 2)
    assert batch_sizes(DataLoader(data, batch_size=3), None) == (3, 1)
    assert batch_sizes(DataLoader(data, batch_size=3, drop_last=True), None) == (3,)
    sampler = torch.utils.data.SubsetRandomSampler(range(7))
    assert batch_sizes(DataLoader(data, batch_size=3, sampler=sampler), None) == ()  # its own sampler: not known


def test_a_share_names_the_rows_it_holds_where_another_replica_s_are_asked() -> None:
    share = data.Share(torch.zeros(3, 2), torch.zeros(3), rows=7, start=4)
    x, y, offset = data.replica_rows(share, None, 4, 7, "replica 1 of dp=2")
    assert x is share.x and y is share.y and offset == 0 and data.global_rows(share) == 7
    whole = torch.zeros(7, 2)
    assert data.replica_rows(whole, None, 4, 7, "replica 1 of dp=2") == (whole, None, 4)
    with pytest.raises(PlaitError, match=r"a share of rows 4:7 of a batch of 7 came to replica 0 of dp=2, whose "
                                         r"rows are 0:4; read each replica's rows with its dp rank"):
        data.replica_rows(share, None, 0, 4, "replica 0 of dp=2")
