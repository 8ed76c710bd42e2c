"""Shared-memory rings: bytes in order, messages larger than a ring streamed, a stopped or dead
peer and a late one noticed, and a pipeline on rings equal to one on gloo, leaving /dev/shm clean."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from plait.runtime.comm.rings import RingClosed, Rings
from tests.harness import run_ranks

SECOND = datetime.timedelta(seconds=1)


def _pair(capacity: int = 4096) -> tuple[Rings, Rings]:
    """Rank 0's and rank 1's rings in this one process, over one in-memory store."""
    store = dist.HashStore()
    return (Rings(0, store, SECOND, capacity=capacity, prefix="t"),
            Rings(1, store, SECOND, capacity=capacity, prefix="t"))


def _until(done, *rings: Rings, limit_s: float = 5.0) -> None:
    """Move both ends' messages (this one thread plays both ranks) until `done()`."""
    end = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < end, "the rings stopped moving"
        for r in rings:
            r.progress()


def test_messages_of_every_dtype_arrive_in_order_and_equal():
    a, b = _pair()
    sent = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.tensor([True, False, True]),
            torch.arange(11), torch.empty(0), torch.randn(2, 2).to(torch.float16)]
    works = [a.isend(t, 1, tag) for tag, t in enumerate(sent)]
    got = [torch.empty_like(t) for t in sent]
    receives = [b.irecv(g, 0, tag) for tag, g in enumerate(got)]
    _until(lambda: all(w.done for w in works + receives), a, b)
    for s, g in zip(sent, got):
        assert s.dtype == g.dtype and torch.equal(s, g)


def test_a_message_larger_than_the_ring_streams_through_it_in_pieces():
    a, b = _pair(capacity=1024)  # 1 KiB ring, a 40 KiB message
    big, out = torch.randn(10_000), torch.empty(10_000)
    send = a.isend(big, 1, 7)
    assert not send.done  # only what fits went in
    receive = b.irecv(out, 0, 7)
    _until(lambda: send.done and receive.done, a, b)
    assert torch.equal(big, out)
    # the ring wrapped many times over; later messages still line up
    again, into = torch.arange(300), torch.empty(300, dtype=torch.int64)
    works = [a.isend(again, 1, 8), b.irecv(into, 0, 8)]
    _until(lambda: all(w.done for w in works), a, b)
    assert torch.equal(again, into)


def test_a_message_out_of_order_is_an_error_naming_both_tags():
    a, b = _pair()
    a.isend(torch.zeros(4), 1, tag=3)
    with pytest.raises(RingClosed, match="tag 3 .* expected tag 5"):
        receive = b.irecv(torch.empty(4), 0, tag=5)
        _until(lambda: receive.done, a, b, limit_s=2)


def test_a_wait_times_out_or_ends_at_once_when_the_peer_closes_its_rings():
    a, b = _pair()
    a.isend(torch.zeros(1), 1, 0)
    first = b.irecv(torch.empty(1), 0, 0)
    _until(lambda: first.done, a, b)
    with pytest.raises(RuntimeError, match="Timed out waiting 0 s for a message with rank 0 .tag 1."):
        b.wait(b.irecv(torch.empty(2), 0, 1), datetime.timedelta(seconds=0.2))
    b.links[0].receives.clear()  # the timed-out receive dropped, as a failing wire drops its own
    a.close()
    start = time.monotonic()
    with pytest.raises(RingClosed, match="rank 0 stopped"):
        b.wait(b.irecv(torch.empty(2), 0, 1), datetime.timedelta(seconds=20))
    assert time.monotonic() - start < 2.0
    with pytest.raises(RingClosed, match="closed"):
        a.isend(torch.zeros(1), 1, 2)  # a closed rank sends nothing more


def test_a_wait_ends_when_the_peers_process_is_gone():
    a, b = _pair()
    a.isend(torch.zeros(1), 1, 0)
    b.irecv(torch.empty(1), 0, 0)
    _until(lambda: b.links[0].inn is not None and not b.links[0].receives, a, b)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    b.links[0].pid = gone.pid  # as if rank 0 were that process
    with pytest.raises(RingClosed, match=f"pid {gone.pid}\\) is gone"):
        b.wait(b.irecv(torch.empty(1), 0, 1), datetime.timedelta(seconds=20))


def test_a_rank_that_only_receives_from_a_peer_makes_no_ring_to_it():
    a, b = _pair()
    b.irecv(torch.empty(1), 0, 0)  # waiting on rank 0, which has sent nothing yet
    assert b.links[0].out is None and b.links[0].inn is None
    sent = a.isend(torch.ones(1), 1, 0)
    assert a.links[1].out is not None and a.links[1].inn is None
    _until(lambda: sent.done and not b.links[0].receives, a, b)
    assert b.links[0].inn is not None and b.links[0].out is None


def test_ranks_of_another_host_are_not_reached():
    store = dist.HashStore()
    a = Rings(0, store, SECOND, prefix="h")
    store.set("h/host/1", "another-boot:1:2:3")
    assert not a.reaches(1)
    b = Rings(2, store, SECOND, prefix="h")
    assert a.reaches(2) and b.reaches(0)


def _rings_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("plait-ring-")}


def train_two_stages(rank: int, world: int, rings: str) -> tuple[list[torch.Tensor], bool]:
    """Two stages x 2 micro-batches, 1F1B, 3 SGD steps of a small GPT-2, messages by rings or by gloo."""
    os.environ["PLAIT_RINGS"] = rings
    from torch import nn

    import plait
    from tests.models import mlp

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g)
    torch.manual_seed(0)
    net = mlp()
    model = plait.Model(net, plait.Config(layers_per_stage=(5, 6), num_microbatches=4),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss=nn.CrossEntropyLoss())
    for a in range(0, 24, 8):
        model.train_on_batch(x[a:a + 8], y[a:a + 8])
    wire = model._train.pipe.interpreter.wire  # which way the messages went
    used = wire.rings is not None and 1 - rank in wire.rings.links
    return [p.detach().clone() for p in net.parameters() if p.device.type != "meta"], used  # its stage's


@pytest.mark.timeout(120)
def test_a_pipeline_on_rings_trains_exactly_as_on_gloo_and_leaves_dev_shm_clean():
    before = _rings_files()
    ringed = run_ranks(2, train_two_stages, "1", timeout=100)
    assert _rings_files() == before
    plain = run_ranks(2, train_two_stages, "0", timeout=100)
    assert [used for _, used in ringed] == [True, True]
    assert [used for _, used in plain] == [False, False]
    for (mine, _), (theirs, _) in zip(ringed, plain):
        for p, q in zip(mine, theirs):
            assert torch.equal(p, q)  # the transport moves bytes: the arithmetic is the same
    assert ringed[0][0] and ringed[1][0]  # each rank holds (and compared) a stage
