"""plait.runtime.comm.waiting: when a rank polls its waits, and that a polled wait ends as the Work does."""

from __future__ import annotations

import datetime

import pytest

from plait.errors import ConfigError
from plait.runtime.comm.waiting import WAIT_ENV, finish, polls
from tests.harness import run_ranks


class FakeWork:
    """A Work that is done after `after` looks at it; `wait` records its timeout and raises `error`."""

    def __init__(self, after: int | None, error: Exception | None = None):
        self.after, self.error, self.looks, self.waited = after, error, 0, []

    def is_completed(self) -> bool:
        self.looks += 1
        return self.after is not None and self.looks > self.after

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waited.append(timeout)
        if self.error is not None:
            raise self.error
        return True


def test_the_environment_forces_either_way_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(WAIT_ENV, "poll")
    assert polls()
    monkeypatch.setenv(WAIT_ENV, "block")
    assert not polls()
    monkeypatch.setenv(WAIT_ENV, "spin")
    with pytest.raises(ConfigError, match="PLAIT_WAIT='spin'.*'poll', 'block'"):
        polls()


def test_no_process_group_blocks(monkeypatch):
    monkeypatch.delenv(WAIT_ENV, raising=False)
    assert not polls()


def test_a_polled_wait_looks_until_the_work_is_done_then_takes_its_result(monkeypatch):
    monkeypatch.setenv(WAIT_ENV, "poll")
    work = FakeWork(after=5)
    finish(work, datetime.timedelta(seconds=10))
    assert work.looks == 6 and work.waited == [datetime.timedelta(seconds=10)]
    failed = FakeWork(after=0, error=RuntimeError("peer closed the connection"))
    with pytest.raises(RuntimeError, match="peer closed"):
        finish(failed)


def test_a_polled_wait_past_its_timeout_lets_the_works_wait_raise(monkeypatch):
    monkeypatch.setenv(WAIT_ENV, "poll")
    never = FakeWork(after=None, error=RuntimeError("Wait timeout"))
    with pytest.raises(RuntimeError, match="Wait timeout"):
        finish(never, datetime.timedelta(milliseconds=20))
    assert never.looks > 1 and never.waited == [datetime.timedelta(milliseconds=1)]


def test_a_blocked_wait_never_polls(monkeypatch):
    monkeypatch.setenv(WAIT_ENV, "block")
    work = FakeWork(after=None)
    finish(work)
    assert work.looks == 0 and work.waited == [None]


def polled_collectives(rank, world):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        total = torch.full((1000,), float(rank + 1))
        finish(dist.all_reduce(total, async_op=True))
        parts = [torch.empty(3) for _ in range(world)]
        finish(dist.all_gather(parts, torch.full((3,), float(rank)), async_op=True))
        return polls(), total[0].item(), [p[0].item() for p in parts]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_two_gloo_ranks_on_two_cores_poll_and_their_collectives_are_right(monkeypatch):
    monkeypatch.delenv(WAIT_ENV, raising=False)
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: one gloo rank per core is when plait polls")
    for polled, total, gathered in run_ranks(2, polled_collectives, timeout=50):
        assert polled and total == 3.0 and gathered == [0.0, 1.0]
