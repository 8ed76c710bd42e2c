"""Links and collectives: the time to move bytes, latency + bytes / bandwidth (Hockney 1994).

Collective costs for V bytes per device on p devices over links of bandwidth B and latency
alpha (Thakur et al. 2005, MPICH's ring and tree algorithms), with one alpha per message step
of the ring or tree, and a collective's own fixed cost `base` once per call (NCCL's tuning
model, src/graph/tuning.cc: latency = baseLat + steps x hwLat):

    point to point      alpha + V/B
    ring all-reduce     base + 2(p-1) alpha + 2(p-1)V/(pB)
    tree all-reduce     base + 2 ceil(log2 p) (alpha + V/B)   (a reduce, then a broadcast)
    all-gather          base + (p-1) alpha + (p-1)V/B
    reduce-scatter      base + (p-1) alpha + (p-1)V/(pB)
    broadcast / reduce  base + ceil(log2 p) (alpha + V/B)
    by owner (ZeRO)     p broadcasts (or reduces) of V/p, one from each owner in turn

An all-reduce runs as a ring, or, on a link whose library also runs trees and takes the faster
(`Link.tree`: NCCL, which chooses among its algorithms by the same kind of model; gloo's
all-reduce is a ring), as the faster of the two: the tree where many ranks sum a few bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from plait.errors import ConfigError

__all__ = [
    "Link",
    "Network",
    "point_to_point",
    "messages_time",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "by_owner",
]


@dataclass(frozen=True)
class Link:
    """One kind of connection: `latency_s` (alpha) per message, `bandwidth` (B) in bytes/s,
    `base_s`, a collective's fixed cost once per call (0 where none was measured or sourced), and
    `tree`: the library runs an all-reduce as a tree where that is faster than a ring (NCCL)."""

    latency_s: float
    bandwidth: float
    base_s: float = 0.0
    tree: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ConfigError(f"link latency must be a finite time >= 0 s, got {self.latency_s!r}")
        if not (math.isfinite(self.base_s) and self.base_s >= 0):
            raise ConfigError(f"a link's base latency per collective must be a finite time >= 0 s, got {self.base_s!r}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ConfigError(
                f"link bandwidth must be a finite number of bytes/s > 0, got {self.bandwidth!r}; "
                "for example 3.125e9 for 25 Gbit/s"
            )

    def collective_s(self, steps: int) -> float:
        """A collective's latency over `steps` message steps: its base once, alpha a step."""
        return self.base_s + steps * self.latency_s

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"latency_s": self.latency_s, "bandwidth": self.bandwidth}
        if self.base_s:
            data["base_s"] = self.base_s
        if self.tree:
            data["tree"] = True
        return data


@dataclass(frozen=True)
class Network:
    """Devices in nodes of `devices_per_node`: `intra` links inside a node, `inter` between.

    Rank r sits on node r // devices_per_node (ranks fill nodes in order, as launchers do).
    `reduce_intra` / `reduce_inter`: the link as the backend's all-reduce sees it, fitted to the
    ring formula from timed all-reduces (a library's all-reduce has costs of its own that a
    ping-pong does not show; docs/benchmarks.md has a measured case); None: the point-to-point
    link. `handover_cpu_s`: the time a pipeline hand-over takes from the sending rank and, again,
    from the receiving one, beside the link's time (CPU ranks: the send, the transport thread's
    turn on the rank's core, posting the receive; measured by `plait.planner.calibrate`); 0
    where a copy engine moves the data while the rank computes (the GPU presets).
    """

    intra: Link
    inter: Link
    devices_per_node: int = 1
    reduce_intra: Link | None = None
    reduce_inter: Link | None = None
    handover_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ConfigError(
                f"devices_per_node must be a positive integer, got {self.devices_per_node!r}"
            )
        if not (math.isfinite(self.handover_cpu_s) and self.handover_cpu_s >= 0):
            raise ConfigError(f"handover_cpu_s must be a finite time >= 0 s, got {self.handover_cpu_s!r}")

    def link(self, ranks: Sequence[int]) -> Link:
        """The slowest link a message or collective among `ranks` crosses."""
        return self.intra if self._one_node(ranks) else self.inter

    def reduce_link(self, ranks: Sequence[int]) -> Link:
        """The link an all-reduce among `ranks` runs at: measured as one, else point to point."""
        measured = self.reduce_intra if self._one_node(ranks) else self.reduce_inter
        return measured or self.link(ranks)

    def _one_node(self, ranks: Sequence[int]) -> bool:
        return len({r // self.devices_per_node for r in ranks}) <= 1

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"intra": self.intra.to_dict(), "inter": self.inter.to_dict(),
                                "devices_per_node": self.devices_per_node}
        for name in ("reduce_intra", "reduce_inter"):
            link = getattr(self, name)
            if link is not None:
                data[name] = link.to_dict()
        if self.handover_cpu_s:
            data["handover_cpu_s"] = self.handover_cpu_s
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Network":
        reduce = {name: Link(**data[name]) for name in ("reduce_intra", "reduce_inter") if data.get(name)}
        return cls(Link(**data["intra"]), Link(**data["inter"]), int(data["devices_per_node"]), **reduce,
                   handover_cpu_s=float(data.get("handover_cpu_s", 0.0)))


def point_to_point(nbytes: float, link: Link) -> float:
    """One message of `nbytes` (0 bytes: no message, no time)."""
    return 0.0 if nbytes <= 0 else messages_time(1, nbytes, link)


def messages_time(count: int, nbytes: float, link: Link) -> float:
    """`count` messages of `nbytes` in all, one after another: `point_to_point` of each, summed."""
    return count * link.latency_s + nbytes / link.bandwidth


def all_reduce(nbytes: float, num_devices: int, link: Link) -> float:
    """All-reduce of `nbytes` per device: a ring, 2(p-1) steps of V/p bytes each; on a link that
    also runs trees, the faster of it and a tree, 2 ceil(log2 p) steps of V bytes."""
    p = num_devices
    if p <= 1 or nbytes <= 0:
        return 0.0
    ring = link.collective_s(2 * (p - 1)) + 2 * (p - 1) * nbytes / (p * link.bandwidth)
    if not link.tree:
        return ring
    hops = 2 * math.ceil(math.log2(p))
    return min(ring, link.collective_s(hops) + hops * nbytes / link.bandwidth)


def all_gather(nbytes: float, num_devices: int, link: Link) -> float:
    """All-gather of `nbytes` per device: each device's V sent on p - 1 times."""
    p = num_devices
    if p <= 1 or nbytes <= 0:
        return 0.0
    return link.collective_s(p - 1) + (p - 1) * nbytes / link.bandwidth


def reduce_scatter(nbytes: float, num_devices: int, link: Link) -> float:
    """Reduce-scatter of `nbytes` per device: p - 1 steps of V/p bytes each."""
    p = num_devices
    if p <= 1 or nbytes <= 0:
        return 0.0
    return link.collective_s(p - 1) + (p - 1) * nbytes / (p * link.bandwidth)


def broadcast(nbytes: float, num_devices: int, link: Link) -> float:
    """Broadcast (or reduce) of `nbytes` over a binary tree of q devices: log2(q) hops."""
    q = num_devices
    if q <= 1 or nbytes <= 0:
        return 0.0
    hops = math.ceil(math.log2(q))
    return link.collective_s(hops) + hops * nbytes / link.bandwidth


def by_owner(nbytes: float, num_devices: int, link: Link) -> float:
    """ZeRO's collectives as the runtime issues them: one reduce (gradients) or broadcast
    (updated parameters) of each owner's 1/p share of `nbytes`, p of them in turn."""
    return num_devices * broadcast(nbytes / num_devices, num_devices, link)
