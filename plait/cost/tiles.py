"""The tile map of cross-mesh resharding: which rank sends which tile of a stage output across a boundary of two widths, and what it costs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.cost.network import Link, all_gather
from plait.errors import ConfigError

__all__ = ["TileMap", "crossing_time"]


@dataclass(frozen=True)
class TileMap:
    """How one value crosses from a stage of `senders` tp ranks to one of `receivers` (Alpa's
    cross-mesh resharding, for a value replicated over both stages' tp ranks).

    The value (flattened in memory order) is cut into n = max(senders, receivers) tiles; tile k
    goes from sender k % senders to receiver k % receivers, and the receiving stage all-gathers the
    tiles locally. Every sender sends and every receiver receives at least one tile, and the slow
    link between the stages carries the value once, not once per receiver. Senders 2, receivers 1
    (narrowing) and senders 1, receivers 2 (widening)::

        sender 0 --tile 0--> receiver 0           sender 0 --tile 0--> receiver 0 -+ all-gather
        sender 1 --tile 1--> receiver 0           sender 0 --tile 1--> receiver 1 -+ (local)

    Gradients go back by the mirrored map (`reversed`): the same pairs, the same tiles, the stage
    that sent the activations all-gathering them. A tensor of fewer than n elements (or not
    floating point) is not cut: each pair's message carries it whole.

    `whole`: every receiver gets the whole value over the link and nothing is gathered (cheaper
    than a local all-gather where the link is as fast as the stage's own, or the value small).
    The value is cut into n = senders tiles, sender i sends tile i to every receiver; the
    gradients go back by the whole map of the other direction (receiver j sends every sender
    tile j of n = receivers)::

        sender 0 --tile 0 (all)--> receiver 0      sender 0 --tile 0--> receiver 0 and 1
        sender 0 --tile 0 (all)--> receiver 1      sender 1 --tile 1--> receiver 0 and 1
    """

    senders: int
    receivers: int
    whole: bool = False

    def __post_init__(self) -> None:
        for name, value in (("senders", self.senders), ("receivers", self.receivers)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TileMap has {name}={value!r}; it must be a positive integer (a stage's tp)")

    @property
    def num_tiles(self) -> int:
        """n = max(senders, receivers): one tile per rank of the wider stage (whole: one per sender)."""
        return self.senders if self.whole else max(self.senders, self.receivers)

    @property
    def gathers(self) -> bool:
        """Whether the receiving stage all-gathers (it has more than one rank and got tiles)."""
        return self.receivers > 1 and not self.whole

    def reversed(self) -> "TileMap":
        """The map of the gradients: the receivers send back to the senders, tile for tile (whole:
        each receiver its tile of n = receivers to every sender)."""
        return TileMap(self.receivers, self.senders, self.whole)

    def tile(self, sender: int, receiver: int) -> int | None:
        """The tile `sender` sends `receiver`, or None (this pair exchanges nothing)."""
        self._check(sender, receiver)
        if self.whole:
            return sender
        found = [k for k in range(self.num_tiles) if k % self.senders == sender and k % self.receivers == receiver]
        return found[0] if found else None

    def receivers_of(self, sender: int) -> tuple[int, ...]:
        """The receivers `sender` sends a tile to, in tile order."""
        self._check(sender, 0)
        if self.whole:
            return tuple(range(self.receivers))
        return tuple(k % self.receivers for k in range(sender, self.num_tiles, self.senders))

    def senders_of(self, receiver: int) -> tuple[int, ...]:
        """The senders `receiver` gets a tile from, in tile order."""
        self._check(0, receiver)
        return tuple(k % self.senders for k in self.held(receiver))

    def held(self, receiver: int) -> tuple[int, ...]:
        """The tiles `receiver` holds before its stage's all-gather (whole: all of them)."""
        if self.whole:
            return tuple(range(self.num_tiles))
        return tuple(range(receiver, self.num_tiles, self.receivers))

    def bounds(self, numel: int, k: int) -> tuple[int, int]:
        """Elements [lo, hi) of tile k of a flattened value of `numel` elements (sizes differ by one at most)."""
        n = self.num_tiles
        return k * numel // n, (k + 1) * numel // n

    def cuts(self, numel: int) -> bool:
        """Whether a value of `numel` elements is cut into tiles (else it crosses whole)."""
        return numel >= self.num_tiles > 1

    def _check(self, sender: int, receiver: int) -> None:
        if not (0 <= sender < self.senders and 0 <= receiver < self.receivers):
            raise ConfigError(f"TileMap({self.senders}, {self.receivers}) has no sender {sender} or receiver "
                              f"{receiver}; senders are 0..{self.senders - 1}, receivers 0..{self.receivers - 1}")


def crossing_time(nbytes: float, senders: int, receivers: int, link: Link, local: Link, whole: bool) -> float:
    """One direction of a crossing of `nbytes` from `senders` to `receivers` ranks: the busiest
    rank's messages and bytes on the `link` between the stages, then (tiles) the receivers'
    all-gather of their shares on their `local` link.

        tiles   q = ceil(n / min(s, r)) tiles of V/n on the busiest rank, + all-gather(V/r, r)
        whole   max(s, r) messages and max(r V/s, V) bytes (every receiver gets V; sender i sends
                its V/s to each of r), no all-gather
    """
    if nbytes <= 0 or (senders == receivers and not whole):
        return 0.0 if nbytes <= 0 else link.latency_s + nbytes / link.bandwidth
    s, r = senders, receivers
    if whole:
        return max(s, r) * link.latency_s + max(r * nbytes / s, nbytes) / link.bandwidth
    n = max(s, r)
    busiest = math.ceil(n / min(s, r))
    return busiest * (link.latency_s + nbytes / n / link.bandwidth) + all_gather(nbytes / r, r, local)

