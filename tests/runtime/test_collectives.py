"""The small collectives of plait.runtime.collectives, on 2 gloo ranks."""

from __future__ import annotations

import pytest

from plait.runtime.collectives import max_floats, sum_floats
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
