"""Failure reports: every failing rank posts where it stood, and each report shows them all.

When a rank's wait fails (a timeout, or a peer whose connection closed), its peers are usually
stuck too and fail moments later. Each posts "run position time" under its own key in the job's
key-value store and waits for the others until the *first* failure's time + `wait_s` (one
deadline for all, so a chain of failures does not add up its waits). A rank that posts nothing
by then is dead or stuck: the report names it. Used only on failure: a healthy step never
touches the store.

Having posted, a failing rank closes its connections (`stop_peers`): a peer waiting on it fails
at once ("Connection closed by peer"), posts and closes its own, and so on down the pipeline, so
every rank ends within moments of the first failure instead of one timeout per wait. A rank whose
own code raised (the model's forward, the loss: not a transport failure) posts that as its cause,
and the others name it: the user reads the exception and where it was raised, not a timeout.

    t0 rank 1 killed   t0+ rank 0: connection closed -> posts, waits    ... t0+wait_s every
                       t0+timeout_s rank 2: its wait times out -> posts      report: "no report
                                                                             from ranks [1]"
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from plait.errors import ModelError, PipelineError, first_line, model_frame
from plait.runtime.comm.shared_rings import close_all

__all__ = ["Failures", "gather_failures", "report_wait", "failure_error", "stop_peers", "stopped_by", "posted",
           "raised_before_steps"]

PREFIX = "plait/failure"  # each rank's post: PREFIX/<rank> (under `plait run`, each restart has a key space of its own)


def report_wait(timeout_s: float) -> float:
    """How long after the first failure the reports are collected: about one more timeout."""
    return min(max(5.0, timeout_s + 2.0), 30.0)


@dataclass
class Failures:
    """What the failing ranks posted: positions in this run, and every rank that answered."""

    world_size: int
    positions: dict[int, int]  # rank -> position in the same run (program) as ours
    reported: set[int] = field(default_factory=set)  # ranks that posted, in any run
    store_error: str | None = None  # why the store could not be used (its host may be dead)
    causes: dict[int, str] = field(default_factory=dict)  # rank -> what its own code raised, where one did

    def first_cause(self, rank: int) -> tuple[int, str] | None:
        """Another rank whose own code raised, with what it posted (the lowest such rank)."""
        return next(((r, c) for r, c in sorted(self.causes.items()) if r != rank and c), None)

    @property
    def silent(self) -> list[int]:
        """Ranks that posted nothing: dead, or stuck where no timeout reaches them."""
        return sorted(set(range(self.world_size)) - self.reported)

    def describe(self) -> str:
        """One line for an error message, naming the silent ranks (or why nobody could answer)."""
        if self.store_error is not None:
            return (f"the job's key-value store is unreachable ({self.store_error}): the process "
                    f"hosting it (rank 0, or the launcher) has probably died")
        if not self.silent:
            return "every rank reported a failure"
        return f"no report from ranks {self.silent} (dead, or stuck where no timeout reaches)"


def gather_failures(run_id: int, rank: int, position: int, wait_s: float = 3.0, cause: str = "") -> Failures:
    """Post this rank's failure at `position` of run `run_id` (and `cause`: what its own code
    raised, if it did), close its connections; collect the others' (see above)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return Failures(1, {rank: position}, {rank})
    world_size = dist.get_world_size()
    failures = Failures(world_size, {rank: position}, {rank})
    start = time.time()
    prefix = PREFIX
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{prefix}/{rank}", f"{run_id} {position} {start:.3f} {cause}")
        stop_peers()
        keys = {r: f"{prefix}/{r}" for r in range(world_size) if r != rank}
        first = start
        while True:
            for r, key in list(keys.items()):
                if store.check([key]):
                    run, pos, when, *posted = store.get(key).decode().split(" ", 3)
                    failures.reported.add(r)
                    failures.causes[r] = posted[0] if posted else ""
                    if int(run) == run_id:
                        failures.positions[r] = int(pos)
                    first = min(first, float(when))
                    del keys[r]
            if not keys or time.time() >= first + wait_s:
                break
            time.sleep(0.1)
    except Exception as e:  # noqa: BLE001 - the store may be gone with a dead rank; report what we have
        stop_peers()
        failures.store_error = f"{type(e).__name__}: {first_line(e)}"[:200]
    return failures


def stop_peers() -> None:
    """Close this rank's connections in every gloo group it belongs to: each peer's pending wait on
    it fails at once. A gloo wait that times out closes every connection of its group (gloo's own
    "Application timeout caused pair closure"), so one receive that nobody sends, waited for 1 ms,
    closes them. NCCL groups are left to their own timeouts."""
    if not dist.is_initialized():
        return
    close_all()  # the rings to this host's ranks (rings.py)
    me = dist.get_rank()
    for group in list(dist.distributed_c10d._world.pg_map):
        try:
            if dist.get_backend(group) != "gloo":
                continue
            peers = [r for r in dist.get_process_group_ranks(group) if r != me]
        except Exception:  # noqa: BLE001 - a group torn down already
            continue
        for peer in peers:  # the first whose connection is still open closes them all
            try:
                work = dist.irecv(torch.empty(1), peer, group=group, tag=_NOBODY_SENDS)
                assert work is not None  # a rank of the group always gets a Work
                work.wait(datetime.timedelta(milliseconds=1))
            except Exception as e:  # noqa: BLE001 - the expected end: a timeout, or a connection closed already
                if "Timed out" in str(e):
                    break


_NOBODY_SENDS = 2**30  # a message tag no plait message uses (theirs count micro-batches and stages)


def failure_error(what: str, rank: int, error: BaseException, timeout_s: float,
                  run_id: int = -1, position: int = -1) -> PipelineError | ModelError:
    """The PipelineError of a collective outside the schedule (an all-reduce, a checkpoint) that failed.

    Posts this rank's failure like the interpreter does (at `position` of run `run_id`, when the
    failure follows that run), so both kinds of report see each other, and names the silent ranks.
    """
    failures = gather_failures(run_id, rank, position, report_wait(timeout_s))
    text = first_line(error)
    return stopped_by(rank, failures, what) or PipelineError(
        f"rank {rank} failed in {what}: {type(error).__name__}: {text}\n{failures.describe()}")


def stopped_by(rank: int, failures: Failures, where: str) -> PipelineError | ModelError | None:
    """The error of a rank that stopped because another rank's own code raised (None: none did)."""
    found = failures.first_cause(rank)
    if found is None:
        return None
    other, cause = found
    kind = ModelError if cause.startswith("raised") else PipelineError
    return kind(f"rank {rank} stopped ({where}): rank {other} {cause}\n(rank {other}'s own output shows "
                f"its traceback; this rank's wait ended when rank {other} closed its connections)")


def posted(store: Any, rank: int) -> bool:
    """Whether `rank` has posted a failure (a peer waiting on it in the store, not on a connection, asks)."""
    return bool(store.check([f"{PREFIX}/{rank}"]))


@contextlib.contextmanager
def raised_before_steps(rank: int, where: str) -> Iterator[None]:
    """Where the model's own code raises inside (a ModelError: capturing it, before any step), post
    that on this rank and close its connections: a peer waiting on it ends at once, naming the cause."""
    try:
        yield
    except ModelError as error:
        cause = error.__cause__ or error
        frame, text = model_frame(cause), first_line(cause)
        gather_failures(-1, rank, -1, 2.0, f"raised {type(cause).__name__}: {text} {where}"
                        + (f", at {frame}" if frame else ""))
        raise
