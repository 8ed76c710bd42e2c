"""Hand-overs between a layout's stages: each boundary's link, each cut's time and bytes, and the ranks' time they take."""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from plait.cost.layer_times import fill_share, latency_count
from plait.cost.network import Link, Network, point_to_point
from plait.cost.problem import cuts_allowed
from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import Setting

__all__ = ["boundary_links", "cut_times", "slowest_boundary", "cut_bytes", "handover_busy", "handover_term"]


def boundary_links(setting: Setting, network: Network) -> list[Link]:
    """The link of each stage boundary s -> s + 1: the slowest any replica's pair crosses
    (`Network.link` of the 2 dp ranks: intra when they all sit on one node)."""
    s = np.arange(setting.num_chunks - 1)[:, None]
    replica = np.arange(setting.dp)[None, :] * setting.pp
    here = (replica + s % setting.pp) // network.devices_per_node  # (S - 1, dp) nodes
    there = (replica + (s + 1) % setting.pp) // network.devices_per_node
    low = np.minimum(here.min(axis=1, initial=2**62), there.min(axis=1, initial=2**62))
    high = np.maximum(here.max(axis=1, initial=-1), there.max(axis=1, initial=-1))
    return [network.intra if one else network.inter for one in (low == high).tolist()]


def cut_times(costs: LayerCosts, setting: Setting, network: Network, rows: int) -> list[float]:
    """Hand-over time of a cut after each layer, for the partition: it does not know which
    boundary a cut becomes, so every cut is priced on the slowest boundary link."""
    slowest = slowest_boundary(setting, network)
    return [point_to_point(costs.output_row_bytes[k] * rows, slowest)
            for k in range(costs.num_layers - 1)]


def slowest_boundary(setting: Setting, network: Network) -> Link:
    links = boundary_links(setting, network) or [network.intra]
    return min(links, key=lambda link: (link.bandwidth, -link.latency_s))


@functools.lru_cache(maxsize=64)
def cut_bytes(output_row_bytes: tuple[float, ...], uncuttable: tuple[tuple[int, int], ...]
               ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.intp]]:
    """Prefix sums of the allowed cuts' bytes per row (after layer k: its output), fewest first,
    and of how many are messages (more than 0 bytes): the cheapest k cuts' bytes and message
    count in two lookups."""
    allowed = cuts_allowed(len(output_row_bytes), uncuttable)
    sizes = np.sort(np.asarray([b for b, ok in zip(output_row_bytes[:-1], allowed) if ok], dtype=np.float64))
    return (np.concatenate(([0.0], np.cumsum(sizes))),
            np.concatenate(([0], np.cumsum(sizes > 0))).astype(np.intp))


def handover_busy(num_chunks: int, handover_cpu_s: float) -> list[float]:
    """What hand-overs add to each chunk's F and, again, to its B: `handover_cpu_s` per boundary
    it sends or receives across (a forward's input and output, a backward's gradients)."""
    return [handover_cpu_s * ((s > 0) + (s < num_chunks - 1)) for s in range(num_chunks)]


def handover_term(setting: Setting, handover_cpu_s: float) -> float:
    """The closed form's share of `handover_busy`: each chunk's time grows by twice its busy (F
    and B), in the fill (1/v of it interleaved) and in the bottleneck; the same for every cut,
    so the partition's argmin does not move and the term is added after it."""
    if not handover_cpu_s or setting.num_chunks < 2:
        return 0.0
    busy = [2 * x for x in handover_busy(setting.num_chunks, handover_cpu_s)]
    share = fill_share(setting)
    count = latency_count(setting)
    return share * sum(busy) + count * max(busy)
