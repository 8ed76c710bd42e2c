"""The wire protocol: any mix of values arrives intact; descriptions travel once per peer and key."""

import pytest
import torch

from tests.harness import run_ranks


def exchange(rank, world):
    import torch.distributed as dist

    from plait.runtime.wire import Wire

    dist.init_process_group("gloo")
    wire = Wire(timeout_s=20)
    message = [torch.arange(6.0).view(2, 3).requires_grad_(), 7, 2.5, True, None,
               (torch.tensor([1, 2]), {"k": torch.ones(1, dtype=torch.bool)}), torch.Size([4, 5])]
    if rank == 0:
        for step in range(2):  # the second time no description is sent
            for peer in range(1, world):
                wire.send(message, peer, key="m", tag=0)
        wire.drain()
        return None
    got = [wire.recv(0, key="m", tag=0)[0] for _ in range(2)]
    return got


@pytest.mark.timeout(90)
def test_mixed_values_reach_every_peer():
    # Three ranks: rank 0 sends the same key to two peers. Regression: the description was
    # cached per key only, so the second peer got data where it waited for a description.
    results = run_ranks(3, exchange, timeout=80)
    for got in results[1:]:
        for values in got:
            t, i, f, b, none, (ints, d), size = values
            torch.testing.assert_close(t, torch.arange(6.0).view(2, 3))
            assert t.requires_grad  # it required grad on the sender: it is a gradient leaf here
            assert (i, f, b, none) == (7, 2.5, True, None)
            assert type(i) is int and type(b) is bool
            assert ints.tolist() == [1, 2] and d["k"].dtype == torch.bool
            assert tuple(size) == (4, 5)
