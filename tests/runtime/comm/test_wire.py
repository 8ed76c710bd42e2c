"""The wire protocol: any mix of values arrives intact; descriptions travel once per peer and key."""

import pytest
import torch

from tests.harness import run_ranks


def exchange(rank, world):
    import torch.distributed as dist

    from plait.runtime.comm.wire import Wire

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

    from plait.runtime.comm.wire import Wire

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
    from plait.runtime.comm.wire import describe, dim_order

    x = torch.randn(2, 3, 4)
    assert dim_order(x) == (0, 1, 2)
    assert dim_order(x.transpose(1, 2)) == (0, 2, 1)
    assert dim_order(x.permute(2, 0, 1)) == (1, 2, 0)
    assert dim_order(torch.randn(5, 1, 3)) == (0, 1, 2)  # a size-1 dimension keeps its place
    t = x.transpose(1, 2)
    assert t.permute(dim_order(t)).is_contiguous()  # what the wire sends: no copy
    assert describe([t, 3, None]).orders == ((0, 2, 1), (), ())


def _strided_values():
    """Values a stage may send: a transposed, a sliced, an expanded and a permuted activation
    (one requiring grad, one not), integers, numbers, None and a size."""
    base = torch.arange(24.0).view(2, 3, 4)
    return [base.transpose(1, 2).requires_grad_(False).clone().transpose(1, 2).requires_grad_(),
            base[:, 1:, ::2], base[:, :1].expand(2, 5, 4), base.permute(2, 0, 1).requires_grad_(),
            torch.arange(5), 3, 0.25, False, None, {"k": (base.t() if base.dim() == 2 else base[0].t(),)},
            torch.Size([2, 3])]


def received_over_the_wire(rank, world):
    import torch.distributed as dist

    from plait.runtime.comm.wire import Wire

    dist.init_process_group("gloo")
    wire = Wire(timeout_s=20)
    if rank == 0:
        wire.send(_strided_values(), 1, key="v", tag=0)
        wire.drain()
        return None
    return wire.recv(0, key="v", tag=0)[0]


@pytest.mark.timeout(90)
def test_as_received_is_what_the_wire_hands_over():
    # The planner's profiler runs each layer on `as_received` values; the runtime on what the
    # wire delivers. They must agree leaf for leaf: values, strides, leaves requiring grad, types.
    import torch.utils._pytree as pytree

    from plait.runtime.comm.wire import as_received

    got = run_ranks(2, received_over_the_wire, timeout=80)[1]
    sent = _strided_values()
    local = as_received(sent)
    assert pytree.tree_structure(local) == pytree.tree_structure(got)
    for a, b, s in zip(pytree.tree_leaves(local), pytree.tree_leaves(got), pytree.tree_leaves(
            [tuple(v) if isinstance(v, torch.Size) else v for v in sent])):
        assert type(a) is type(b), (a, b)
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert a.stride() == b.stride() and a.requires_grad == b.requires_grad == s.requires_grad
            assert a.is_leaf and a.data_ptr() != s.data_ptr()  # a new leaf, never the sender's memory
        else:
            assert a == b
