"""The data-parallel gradient all-reduce's buckets at run time (their assignment: tests/cost/test_buckets.py)."""

import pytest
import torch


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone, destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_gradients_land_in_the_buckets_without_zeroing_them(one_rank_group):
    # The story: buffers were zeroed every step and autograd added into them (zero + add: two
    # passes more than needed). Now the first gradient of a step is copied into its view and later
    # micro-batches accumulate there; a parameter with no gradient this step must still count as 0.
    from plait.runtime.dp.grad_sync import GradientBuckets

    torch.manual_seed(0)
    used, unused = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    params = [*unused.parameters(), *used.parameters()]
    sync = GradientBuckets(params, one_rank_group, bucket_bytes=2**20, timeout_s=10)
    assert len(sync.buckets) == 1 and len(sync.buckets[0]) == 4  # one bucket: one flat buffer
    sync._flats[0][0].fill_(7.0)  # stale values from an earlier step must not leak into this one
    unused.weight.grad = torch.full_like(unused.weight, 5.0)  # stale too: not this step's
    sync.prepare(num_microbatches=2)
    assert all(p.grad is None for p in params)
    x1, x2 = torch.randn(2, 4), torch.randn(5, 4)
    used(x1).sum().backward()
    used(x2).sum().backward()
    sync.finish()
    assert all(p.grad is sync._view_of[id(p)] for p in params)  # each .grad is its bucket's view
    torch.testing.assert_close(used.weight.grad, torch.ones(3, 2) @ x1 + torch.ones(3, 5) @ x2)
    torch.testing.assert_close(used.bias.grad, torch.full((3,), 7.0))  # 2 + 5 rows
    assert float(unused.weight.grad.abs().max()) == 0.0 and float(unused.bias.grad.abs().max()) == 0.0
    assert sync.launched_during_backward == 0  # the unused layer's gradients never came: flushed
    sync.remove()


def test_a_large_gradient_is_reduced_where_autograd_put_it(one_rank_group, monkeypatch):
    # Copying every gradient into a bucket's buffer cost a pass over it (26 ms a step of 134 MB of
    # gradients on 2 CPU ranks). A gradient of ALONE_BYTES or more is reduced in place instead; the
    # small ones still share one buffer.
    from plait.runtime.dp import grad_sync

    monkeypatch.setattr(grad_sync, "ALONE_BYTES", 48)  # a Linear(4, 3)'s weight: 48 bytes, its bias 12
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    params = [*unused.parameters(), *used.parameters()]
    sync = grad_sync.GradientBuckets(params, one_rank_group, bucket_bytes=2**20, timeout_s=10)
    assert [len(share) for _, share in sync._segments[0]] == [1, 1, 2]  # 2 weights alone, the biases
    assert sync._flats[0][:2] == [None, None]  # no buffers for the weights
    for step in range(2):  # the second step must not see the first one's gradients
        unused.weight.grad = torch.full_like(unused.weight, 5.0)  # stale: not this step's
        sync.prepare(num_microbatches=2)
        x1, x2 = torch.randn(2, 4), torch.randn(5, 4)
        used(x1).sum().backward()
        made = used.weight.grad.data_ptr()  # autograd's tensor
        used(x2).sum().backward()
        sync.finish()
        assert used.weight.grad.data_ptr() == made  # accumulated in place, reduced in place: no copy
        assert any(f is not None and f.data_ptr() == made for f in sync._flats[0])
        assert used.bias.grad is sync._view_of[id(used.bias)]  # the small ones: views of one buffer
        assert used.bias.grad.data_ptr() != made and unused.bias.grad is sync._view_of[id(unused.bias)]
        torch.testing.assert_close(used.weight.grad, torch.ones(3, 2) @ x1 + torch.ones(3, 5) @ x2)
        torch.testing.assert_close(used.bias.grad, torch.full((3,), 7.0))
        assert float(unused.weight.grad.abs().max()) == 0.0 and float(unused.bias.grad.abs().max()) == 0.0
    sync.remove()
