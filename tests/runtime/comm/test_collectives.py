"""The small collectives of plait.runtime.comm.collectives, on 2 gloo ranks."""

from __future__ import annotations

import pytest

from plait.runtime.comm.collectives import max_floats, sum_floats
from tests.harness import run_ranks


def reduce_both(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mine = [float(rank), 10.0 - rank, -1.5 * rank]
        return max_floats(mine), sum_floats(mine)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_max_and_sum_of_every_ranks_values_on_every_rank():
    for biggest, total in run_ranks(2, reduce_both, timeout=50):
        assert biggest == [1.0, 10.0, 0.0]
        assert total == [1.0, 19.0, -1.5]


def test_one_process_gets_its_values_back():
    assert max_floats([2.0, -3.0]) == [2.0, -3.0] and sum_floats([1.0]) == [1.0]


def broadcast_mixed(rank, world):
    import torch
    import torch.distributed as dist

    from plait.runtime.comm.collectives import broadcast_tensors

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        want = [torch.randn(64, 8, generator=g), torch.randn(3, generator=g), torch.randn(8, 64, generator=g).t(),
                torch.arange(5), torch.randn(2, generator=g), torch.randn(40, generator=g)]
        mine = [w.clone() if rank == 1 else torch.zeros_like(w) for w in want]
        mine[2] = (want[2].t().clone() if rank == 1 else torch.zeros(8, 64)).t()  # a large one not contiguous
        where = [t.data_ptr() for t in mine]
        broadcast_tensors(mine, 1, dist.group.WORLD, chunk_bytes=48, alone_bytes=160)
        return ([bool(torch.equal(t, w)) for t, w in zip(mine, want)],
                [t.data_ptr() == p for t, p in zip(mine, where)])
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_broadcast_tensors_large_ones_in_place_and_the_rest_in_buffers():
    # 64x8 and 40 floats are contiguous and at least 160 bytes: broadcast where they lie; the
    # transposed one, as large, and the small ones (chunks of at most 48 bytes, one per dtype)
    # go through buffers and are copied back into the same tensors
    for equal, same_storage in run_ranks(2, broadcast_mixed, timeout=50):
        assert all(equal) and all(same_storage)
