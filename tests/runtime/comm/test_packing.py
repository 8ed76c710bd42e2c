"""A message's small tensors share one buffer: every dtype and shape comes back bit for bit."""

from __future__ import annotations

import torch

from plait.runtime.comm.packing import PACK_BYTES, Layout, layout, pack, receive_buffers, unpack


def _specs(tensors):
    return [(t.dtype, tuple(t.shape)) for t in tensors]


def _round_trip(tensors):
    plan = layout(_specs(tensors))
    sent = pack(tensors, plan)
    buffers = receive_buffers(_specs(tensors), plan, torch.device("cpu"))
    assert [(b.dtype, b.shape) for b in buffers] == [(s.dtype, s.shape) for s in sent]
    for b, s in zip(buffers, sent):  # what the wire's irecv does
        b.copy_(s)
    return plan, sent, unpack(buffers, _specs(tensors), plan)


def test_small_tensors_of_every_dtype_travel_in_one_buffer_and_come_back_equal():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.tensor([1.5, -2.0], dtype=torch.float64),  # the step's sums ride like this
        torch.tensor([True, False, True]),
        torch.randn(2, dtype=torch.complex64, generator=g),
        torch.randn(7, generator=g).to(torch.float16),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.tensor(3, dtype=torch.int64),  # 0-d
        torch.empty(0, 4),  # empty
        torch.arange(3, dtype=torch.int8),
    ]
    plan, sent, got = _round_trip(tensors)
    assert plan.alone == () and len(sent) == 1 and sent[0].dtype == torch.uint8
    assert all(offset % 16 == 0 for _, offset in plan.packed)
    for want, have in zip(tensors, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have.view(-1).view(torch.uint8) if have.numel() else have,
                           want.reshape(-1).view(torch.uint8) if want.numel() else want)


def test_a_lone_small_tensor_and_large_tensors_go_as_they_are():
    one = [torch.randn(4, 4)]
    assert layout(_specs(one)) == Layout((0,), (), 0)
    plan, sent, got = _round_trip(one)
    assert sent[0] is one[0]  # no copy
    large = torch.randn(PACK_BYTES // 4 + 1)  # one element over the limit
    mixed = [torch.randn(3), large, torch.ones(2, dtype=torch.float64)]
    plan, sent, got = _round_trip(mixed)
    assert plan.alone == (1,) and [i for i, _ in plan.packed] == [0, 2]
    assert sent[0] is large and sent[1].dtype == torch.uint8
    for want, have in zip(mixed, got):
        assert torch.equal(have, want)


def test_unpacked_tensors_own_their_storage():
    # Views into one byte buffer would share a storage across dtypes: torch.save refuses that.
    _, _, got = _round_trip([torch.randn(3), torch.tensor([1, 2])])
    assert got[0].untyped_storage().data_ptr() != got[1].untyped_storage().data_ptr()
    assert got[0].untyped_storage().nbytes() == 3 * 4
