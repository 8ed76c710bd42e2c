"""The row map of cross-mesh resharding along the batch: which replica sends which rows of a micro-batch across a boundary of two dp widths, and what it costs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from plait.cost.network import Link
from plait.errors import ConfigError

__all__ = ["RowMap", "row_block", "check_rows", "row_crossing_time"]


def row_crossing_time(nbytes: float, senders: int, receivers: int, link: Link) -> float:
    """One direction of `nbytes` (a micro-batch's value) from a stage of `senders` replicas to one of
    `receivers`, each pair the rows their blocks share, all at once: the busiest rank's
    ceil(max / min) messages and nbytes / min(senders, receivers) bytes (equal widths: each replica
    its block to its counterpart)."""
    if nbytes <= 0:
        return 0.0
    low, high = min(senders, receivers), max(senders, receivers)
    return math.ceil(high / low) * link.latency_s + nbytes / low / link.bandwidth


def row_block(rows: int, replicas: int, replica: int) -> tuple[int, int]:
    """Rows [lo, hi) of a micro-batch of `rows` rows that `replica` of a stage of `replicas` runs
    (equal contiguous blocks in replica order; `rows` divides by `replicas`, `check_rows`)."""
    share = rows // replicas
    return replica * share, (replica + 1) * share


def check_rows(rows: int, widths: Sequence[int], what: str = "a micro-batch") -> None:
    """Raise ConfigError unless `rows` divides by every stage's replicas (`widths`, stage_dp)."""
    bad = sorted({w for w in widths if rows % w})
    if bad:
        multiple = math.lcm(*widths)
        raise ConfigError(f"{what} of {rows} rows does not divide by dp={bad} of stage_dp={list(widths)} "
                          f"(each replica of a stage runs an equal block of every micro-batch's rows); use a "
                          f"batch size that is num_microbatches x a multiple of {multiple}")


@dataclass(frozen=True)
class RowMap:
    """How the rows of one micro-batch cross from a stage of `senders` data-parallel replicas to one
    of `receivers` (each replica runs its equal block of the rows, `row_block`).

    Receiver j gets from each sender i the rows both hold (their blocks' overlap), in row order,
    and joins them; gradients go back by the same pairs, split by the same rows. Which pairs
    exchange rows does not depend on the micro-batch's size (the blocks scale with it). Senders 2,
    receivers 1 (joining) and senders 1, receivers 2 (splitting), rows of a 4-row micro-batch::

        sender 0 --rows 0:2--> receiver 0          sender 0 --rows 0:2--> receiver 0
        sender 1 --rows 2:4--> receiver 0          sender 0 --rows 2:4--> receiver 1
    """

    senders: int
    receivers: int

    def __post_init__(self) -> None:
        for name, value in (("senders", self.senders), ("receivers", self.receivers)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"RowMap has {name}={value!r}; it must be a positive integer (a stage's dp)")

    def reversed(self) -> "RowMap":
        """The map of the gradients: the receivers send back to the senders, row for row."""
        return RowMap(self.receivers, self.senders)

    def exchange(self, sender: int, receiver: int) -> bool:
        """Whether the blocks of `sender` and `receiver` overlap (at any divisible size)."""
        self._check(sender, receiver)
        # i/a < (j + 1)/b and j/b < (i + 1)/a, in whole numbers
        return sender * self.receivers < (receiver + 1) * self.senders and \
            receiver * self.senders < (sender + 1) * self.receivers

    def receivers_of(self, sender: int) -> tuple[int, ...]:
        """The receivers `sender` sends rows to, in row order."""
        self._check(sender, 0)
        return tuple(j for j in range(self.receivers) if self.exchange(sender, j))

    def senders_of(self, receiver: int) -> tuple[int, ...]:
        """The senders `receiver` gets rows from, in row order."""
        self._check(0, receiver)
        return tuple(i for i in range(self.senders) if self.exchange(i, receiver))

    def overlap(self, sender: int, receiver: int, rows: int) -> tuple[int, int]:
        """The micro-batch's rows [lo, hi) that `sender` sends `receiver` (empty: lo == hi)."""
        self._check(sender, receiver)
        check_rows(rows, (self.senders, self.receivers))
        a, b = row_block(rows, self.senders, sender), row_block(rows, self.receivers, receiver)
        lo, hi = max(a[0], b[0]), min(a[1], b[1])
        return lo, max(lo, hi)

    def _check(self, sender: int, receiver: int) -> None:
        if not (0 <= sender < self.senders and 0 <= receiver < self.receivers):
            raise ConfigError(f"RowMap({self.senders}, {self.receivers}) has no sender {sender} or receiver "
                              f"{receiver}; senders are 0..{self.senders - 1}, receivers 0..{self.receivers - 1}")
