"""Messages between the ranks of one host through shared memory: a byte ring each way, no transport thread.

gloo moves a message through TCP and a device thread on each side: a receive posted ahead sends
its peer a "ready" notice, the data follows, and each hop wakes a thread on cores the ranks'
compute already fills. Between CPU ranks of one host a `Ring` is a file in /dev/shm that both map:
the sender copies a message in and advances `written`, the receiver copies it out and advances
`read`. Nothing has to be woken: a waiting rank polls. Every wait moves every message of its
rank that can move (`Rings.progress`): a send larger than the ring's free space goes in pieces as
the receiver frees it, so no rank waits on a send its peer cannot take yet::

    ring (capacity C, a multiple of 64)   [header 64 B: tag, bytes][payload, padded to 64 B][header]...
    sender: writes at written % C while written - read < C, then publishes written
    receiver: reads at read % C while read < written, then publishes read

A ring carries its messages in the order they were sent; a rank receives from a peer in the
order the peer sends (the schedule's validator checks it, as NCCL needs), and a header whose tag
is not the one expected is an error. Ordering: x86-64 makes stores visible in program order, so a
receiver that sees `written` advanced sees the bytes before it; elsewhere (aarch64) the rings
are not used and gloo carries every message.

Two ranks use rings when they share /dev/shm and process ids (the same kernel boot, mount and pid
namespace, posted in the job's store); each makes its ring to the other at its first send there,
and the other maps it when it appears: nothing waits at build. A rank that stops (`close_all`)
marks its rings closed and a peer waiting fails at once, as on a closed gloo connection; a peer
whose process is gone is noticed within 0.1 s. `PLAIT_RINGS=0` leaves every message to gloo.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import multiprocessing.util
import os
import platform
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

__all__ = ["Ring", "Rings", "RingWork", "RingClosed", "host_identity"]

SHM = "/dev/shm"
CAPACITY = 8 * 2**20  # bytes a sender may run ahead of its receiver; larger messages stream through
_HEADER = 64 * 4  # written, read, closed, the writer's pid (its reader's liveness check): a cache line each
_WRITTEN, _READ, _CLOSED, _WRITER = 0, 8, 16, 24  # int64 positions in the header
_LIVENESS_S = 0.1  # how often a wait checks that its peer lives


class RingClosed(RuntimeError):
    """The peer stopped (its rings marked closed) or its process is gone."""


class Ring:
    """One direction between two ranks: a byte FIFO in a shared-memory file both have mapped."""

    def __init__(self, path: str, capacity: int = CAPACITY, create: bool = False) -> None:
        """Make the ring's file (`create`: the writer) or map the one the writer made (its capacity)."""
        assert capacity % 64 == 0, "ring capacity must be a multiple of 64 bytes"
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, _HEADER + capacity)  # sparse: pages are taken as the ring first fills them
        else:
            fd = os.open(path, os.O_RDWR)
            capacity = os.fstat(fd).st_size - _HEADER
        self.path, self.capacity = path, capacity
        try:
            self._map = mmap.mmap(fd, _HEADER + capacity)
        finally:
            os.close(fd)
        self.counts = memoryview(self._map)[:_HEADER].cast("q")  # int64 loads and stores, no torch call
        self.data = memoryview(self._map)[_HEADER:]

    def touch(self, writer: bool) -> None:
        """Take the ring's pages now (the writer: zeros; the reader: reads), not one by one
        inside the first messages (a fault each 4 KiB)."""
        if writer:
            self.data[:] = bytes(self.capacity)
        else:
            sum(self.data[i] for i in range(0, self.capacity, 4096))

    def written(self) -> int:
        return self.counts[_WRITTEN]

    def read(self) -> int:
        return self.counts[_READ]

    def copy_in(self, at: int, src: memoryview) -> None:
        """Copy bytes `src` into the ring from stream position `at` (wrapping)."""
        start, n = at % self.capacity, len(src)
        first = min(n, self.capacity - start)
        self.data[start:start + first] = src[:first]
        if first < n:
            self.data[:n - first] = src[first:]

    def copy_out(self, at: int, dst: memoryview) -> None:
        """Copy the ring's bytes from stream position `at` into `dst` (wrapping)."""
        start, n = at % self.capacity, len(dst)
        first = min(n, self.capacity - start)
        dst[:first] = self.data[start:start + first]
        if first < n:
            dst[first:] = self.data[:n - first]


@dataclass(eq=False)
class RingWork:
    """A send or receive on a ring: done once its bytes are all in (send) or all out (receive)."""

    rings: "Rings"
    peer: int
    tag: int
    payload: memoryview  # the message's bytes: what is sent, or where it is received
    padded: int  # the payload's length rounded up to 64 bytes
    moved: int = -1  # bytes of the padded payload moved so far; -1: its header not yet
    done: bool = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.rings.wait(self, timeout)
        return True


@dataclass
class _Link:
    """This rank's two rings with one peer, and the messages queued on them."""

    peer: int
    out: Ring | None = None  # made by this rank when it first sends to the peer
    inn: Ring | None = None  # made by the peer when it first sends here: mapped once it is there
    pid: int = 0  # the peer's process (from the ring it made), for the liveness check
    sends: deque[RingWork] = field(default_factory=deque)
    receives: deque[RingWork] = field(default_factory=deque)
    looked: float = 0.0  # when the store was last asked for the peer's ring (not yet made)


class Rings:
    """This rank's rings with the ranks of its host, each made when first used (`reaches`)."""

    def __init__(self, rank: int, store: Any, timeout: timedelta, polls: bool = True, prefix: str = "plait/rings",
                 capacity: int = CAPACITY):
        self.rank, self.store, self.timeout, self.polls, self.prefix = rank, store, timeout, polls, prefix
        self.capacity = capacity
        self.links: dict[int, _Link] = {}
        self.broken: str | None = None
        self._local: dict[int, bool] = {}
        self._host = host_identity()
        store.set(f"{prefix}/host/{rank}", self._host)

    def reaches(self, peer: int) -> bool:
        """Whether messages with `peer` go by ring: it shares this rank's /dev/shm (the same
        kernel's same mount). Asked once per peer; both sides answer alike."""
        local = self._local.get(peer)
        if local is None:
            key = f"{self.prefix}/host/{peer}"
            self.store.wait([key], self.timeout)
            local = self._local[peer] = self.store.get(key).decode() == self._host
        return local

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> RingWork:
        """Queue `tensor` (contiguous) to `peer` and move what fits now."""
        return self._queue(tensor, peer, tag, sending=True)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> RingWork:
        """Queue a receive into `tensor` (contiguous) from `peer`; it fills as the bytes arrive."""
        return self._queue(tensor, peer, tag, sending=False)

    def _queue(self, tensor: torch.Tensor, peer: int, tag: int, sending: bool) -> RingWork:
        link = self._link(peer)
        payload = _bytes(tensor)
        work = RingWork(self, peer, tag, payload, -(-len(payload) // 64) * 64)
        if sending:
            if link.out is None:
                self._make_out(link)
            link.sends.append(work)
            self._push(link)
        else:
            link.receives.append(work)
            self._pull(link)
        return work

    def progress(self) -> bool:
        """Move every queued message's bytes that can move now; True if any did."""
        moved = False
        for link in self.links.values():
            if link.sends:
                moved |= self._push(link)
            if link.receives:
                moved |= self._pull(link)
        return moved

    def wait(self, work: RingWork, timeout: timedelta | None = None) -> None:
        """Poll until `work` is done, moving every message meanwhile; RingClosed when its peer
        stopped or is gone, RuntimeError ("Timed out ...", as gloo says it) after `timeout`."""
        start = checked = time.monotonic()
        limit = None if timeout is None else timeout.total_seconds()
        idle = 0
        while not work.done:
            if self.progress():
                idle = 0
                continue
            idle += 1
            if idle % 32 == 0:
                now = time.monotonic()
                if now - checked > _LIVENESS_S:
                    checked = now
                    self._check_peer(self.links[work.peer])
                if limit is not None and now - start > limit:
                    raise RuntimeError(f"Timed out waiting {limit:.0f} s for a message with rank {work.peer} "
                                       f"(tag {work.tag}) through shared memory")
            if self.polls or idle < 256:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-5 * (idle - 255)))

    def close(self) -> None:
        """Mark every ring of this rank closed: a peer waiting on one fails at once."""
        for link in self.links.values():
            for ring in (link.out, link.inn):
                if ring is not None:
                    ring.counts[_CLOSED] = 1
        self.broken = "this rank stopped after a failure"

    # -- links ---------------------------------------------------------------------------------

    def _link(self, peer: int) -> _Link:
        if self.broken is not None:
            raise RingClosed(f"the rings to rank {peer} are closed: {self.broken}")
        link = self.links.get(peer)
        if link is None:
            link = self.links[peer] = _Link(peer)
            self._attach(link)
        return link

    def _make_out(self, link: _Link) -> Ring:
        """This rank's ring to `link.peer`, made at its first send there (a rank that only receives
        from a peer makes none); the peer maps it from the store and removes its file."""
        path = os.path.join(SHM, f"plait-ring-{uuid.uuid4().hex}")
        _made(path)
        out = link.out = Ring(path, self.capacity, create=True)
        out.counts[_WRITER] = os.getpid()
        out.touch(writer=True)
        self.store.set(f"{self.prefix}/ring/{self.rank}-{link.peer}", path)
        return out

    def _attach(self, link: _Link) -> bool:
        """Map the peer's ring to this rank once the peer has made it (asked at most every ms)."""
        now = time.monotonic()
        if now - link.looked < 1e-3:
            return False
        link.looked = now
        key = f"{self.prefix}/ring/{link.peer}-{self.rank}"
        if not self.store.check([key]):
            return False
        path = self.store.get(key).decode()
        inn = Ring(path)
        os.unlink(path)  # mapped by both ends now: nothing is left in /dev/shm
        inn.touch(writer=False)
        link.inn, link.pid = inn, inn.counts[_WRITER]
        return True

    # -- moving bytes --------------------------------------------------------------------------

    def _push(self, link: _Link) -> bool:
        ring, moved = link.out, False
        assert ring is not None, "a send makes its ring first"
        written, free = ring.written(), ring.capacity - (ring.written() - ring.read())
        while link.sends:
            work = link.sends[0]
            if work.moved < 0:
                if free < 64:
                    break
                struct.pack_into("qq", ring.data, written % ring.capacity, work.tag, len(work.payload))
                written, free, work.moved = written + 64, free - 64, 0
            n = _advance(work, written, free, ring.copy_in)
            written, free, moved = written + n, free - n, True
            if work.moved < work.padded:
                break
            work.done = True
            link.sends.popleft()
        if moved or written != ring.written():
            ring.counts[_WRITTEN] = written  # after the bytes: x86-64 keeps the two stores in order
        return moved

    def _pull(self, link: _Link) -> bool:
        if link.inn is None and not self._attach(link):
            return False
        ring, moved = link.inn, False
        assert ring is not None
        read, available = ring.read(), ring.written() - ring.read()
        while link.receives:
            work = link.receives[0]
            if work.moved < 0:
                if available < 64:
                    break
                tag, count = struct.unpack_from("qq", ring.data, read % ring.capacity)
                if tag != work.tag or count != len(work.payload):
                    self.broken = (f"rank {link.peer} sent a message of tag {tag} and {count} bytes where this "
                                   f"rank expected tag {work.tag} and {len(work.payload)} bytes")
                    raise RingClosed(f"messages out of order: {self.broken}")
                read, available, work.moved = read + 64, available - 64, 0
            n = _advance(work, read, available, ring.copy_out)
            read, available, moved = read + n, available - n, True
            if work.moved < work.padded:
                break
            work.done = True
            link.receives.popleft()
        if moved:
            ring.counts[_READ] = read  # after the bytes are out: the sender may overwrite them
        return moved

    def _check_peer(self, link: _Link) -> None:
        if any(r is not None and r.counts[_CLOSED] for r in (link.out, link.inn)):
            raise RingClosed(f"Connection closed by peer: rank {link.peer} stopped")
        if not link.pid:
            return  # the peer has not made its ring yet: the wait's timeout covers it
        try:
            os.kill(link.pid, 0)
        except ProcessLookupError:
            raise RingClosed(f"Connection closed by peer: rank {link.peer}'s process (pid {link.pid}) is gone") from None
        except PermissionError:  # alive, another user's
            pass


def _advance(work: RingWork, at: int, room: int, copy: Any) -> int:
    """Move up to `room` bytes of `work`'s padded payload at stream position `at` with `copy`
    (`Ring.copy_in` or `copy_out`; the padding is passed over, not copied); how many moved."""
    n = min(room, work.padded - work.moved)
    real = min(n, max(0, len(work.payload) - work.moved))
    if real:
        copy(at, work.payload[work.moved:work.moved + real])
    work.moved += n
    return n


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place (any dtype: seen as uint8)."""
    assert tensor.is_contiguous(), "ring messages are contiguous tensors"
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")


# -- connecting ---------------------------------------------------------------------------------

_MADE: set[str] = set()  # ring files this process made: removed at exit if their reader never mapped them


def host_identity() -> str:
    """What two ranks share exactly when they share /dev/shm and process ids: the kernel's boot,
    the mount, the pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = platform.node()
    shm = os.stat(SHM)
    try:
        pids = os.stat("/proc/self/ns/pid").st_ino  # a peer's pid means the same process here
    except OSError:
        pids = 0
    return f"{boot}:{shm.st_dev}:{shm.st_ino}:{pids}"


def _made(path: str) -> None:
    """Remember a ring file this process makes, to remove it at exit if its reader never mapped it
    (a reader removes it on mapping): at the interpreter's exit, and at a forked multiprocessing
    child's, which ends in os._exit (its finalizers run, atexit's do not)."""
    if not _MADE:
        multiprocessing.util.Finalize(None, _remove_made, exitpriority=0)
    _MADE.add(path)


@atexit.register
def _remove_made() -> None:
    for path in list(_MADE):
        with contextlib.suppress(OSError):
            os.unlink(path)
    _MADE.clear()
