"""Bucket assignment of the data-parallel gradient all-reduce (pure: sizes in, indices out)."""

import pytest
import torch

from plait.cost.buckets import ALONE_BYTES, FIRST_BUCKET_BYTES, assign_buckets, bucket_summary, reduces_to_owners

MB = 2**20
F32 = torch.float32


def test_first_bucket_takes_the_tensor_that_crosses_its_cap():
    # An MLP in backward order: bias (2 KB), weight (1 MB), bias, weight, ...
    sizes = [2048, MB] * 4
    buckets = assign_buckets(sizes, [F32] * 8, cap=25 * MB)
    # The last layer's bias and weight go together (about 1 MB), as DDP does; not the bias alone.
    assert buckets == [[0, 1], [2, 3, 4, 5, 6, 7]]


def test_later_buckets_close_at_the_cap():
    sizes = [MB] * 7
    assert assign_buckets(sizes, [F32] * 7, cap=3 * MB) == [[0], [1, 2, 3], [4, 5, 6]]


def test_a_small_cap_applies_to_the_first_bucket_too():
    assert FIRST_BUCKET_BYTES > 100
    assert assign_buckets([60, 60, 60], [F32] * 3, cap=100) == [[0, 1], [2]]


def test_a_new_dtype_starts_a_new_bucket():
    dtypes = [F32, F32, torch.float64, torch.float64]
    assert assign_buckets([10] * 4, dtypes, cap=MB) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("cap", [1, 100, MB, 25 * MB])
def test_every_tensor_is_in_exactly_one_bucket_in_order(cap):
    sizes = [7, 3000, 2 * MB, 1, 64, MB, 5]
    buckets = assign_buckets(sizes, [F32] * len(sizes), cap)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    assert all(b for b in buckets)


def test_zero2_buckets_go_to_their_owners_except_on_gloo() -> None:
    # one rule for the runtime's GradientBuckets and the cost model's Cluster.owner_reduces
    assert reduces_to_owners("nccl") and not reduces_to_owners("gloo")


def test_the_collectives_the_runtime_issues_for_a_stages_gradients():
    # 4 x (Linear 1024->4096, GELU, Linear 4096->1024) in forward order: 16 MiB of gradients per
    # Linear, none for GELU. Backward order: the first bucket closes at 1 MiB ([16 MiB]), the
    # others at 25 MiB ([16, 16] three times, then [16]): 5 buckets of 8 layers of ALONE_BYTES or
    # more, each reduced where it lies: 8 collectives.
    layers = [16 * MB, 0, 16 * MB] * 4
    assert 16 * MB >= ALONE_BYTES
    assert bucket_summary(layers, 25 * MB) == (16 * MB, 8)
    # small layers share their bucket's buffer: one bucket, one collective, all of their bytes in it
    assert bucket_summary([2048] * 10, 25 * MB) == (20480, 1)
    # a small layer beside a large one in a bucket: the large one alone, the small one in the buffer
    assert bucket_summary([8 * MB, 2048], 25 * MB) == (8 * MB + 2048, 2)
    assert bucket_summary([0, 0], 25 * MB) == (0.0, 0)
