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


def gradients_of_a_transposed_activation(rank, world):
    import torch.distributed as dist

    from plait.runtime.wire import Wire

    dist.init_process_group("gloo")
    wire = Wire(timeout_s=20)
    if rank == 0:
        sent = torch.arange(6.0).view(2, 3).t()  # what a stage may return: not contiguous
        wire.send([sent], 1, key="a", tag=0)
        wire.drain()
        return wire.recv_tensors([sent], 1, tag=1)[0]
    (got,), _ = wire.recv(0, key="a", tag=0)
    wire.send_tensors([(got * 10).t().contiguous().t()], 0, tag=1)  # the gradient, strided alike
    wire.drain()
    return None


@pytest.mark.timeout(90)
def test_gradients_of_a_non_contiguous_activation_come_back():
    # Regression: the receive buffer copied the activation's strides and gloo refused it
    # ("input tensor has to be contiguous") when a planned cut fell after a transpose.
    grad = run_ranks(2, gradients_of_a_transposed_activation, timeout=80)[0]
    torch.testing.assert_close(grad, torch.arange(6.0).view(2, 3).t() * 10)


def test_dim_order_is_memory_order_and_describe_carries_it() -> None:
    from plait.runtime.wire import describe, dim_order

    x = torch.randn(2, 3, 4)
    assert dim_order(x) == (0, 1, 2)
    assert dim_order(x.transpose(1, 2)) == (0, 2, 1)
    assert dim_order(x.permute(2, 0, 1)) == (1, 2, 0)
    assert dim_order(torch.randn(5, 1, 3)) == (0, 1, 2)  # a size-1 dimension keeps its place
    t = x.transpose(1, 2)
    assert t.permute(dim_order(t)).is_contiguous()  # what the wire sends: no copy
    assert describe([t, 3, None]).orders == ((0, 2, 1), (), ())
