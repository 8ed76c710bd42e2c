"""The search over one tp degree for every stage: each tp's layouts on world / tp ranks, ranked together."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from plait.cost.network import Network
from plait.cost.prediction import Cluster
from plait.cost.tp_costs import TpShares, at_tp
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts
from plait.search.search import Candidate, SearchSpace, search

__all__ = ["tp_degrees", "search_tp"]


def tp_degrees(world_size: int, devices_per_node: int, limit: int = 8) -> tuple[int, ...]:
    """The tp to consider: 1 and the powers of two up to `limit` that divide the world and fit a node."""
    out, tp = [1], 2
    while tp <= min(limit, devices_per_node, world_size):
        if world_size % tp == 0:
            out.append(tp)
        tp *= 2
    return tuple(out)


def _lanes(network: Network, tp: int) -> Network:
    """The network the world / tp lanes see: tp consecutive ranks make one lane's device."""
    return replace(network, devices_per_node=max(1, network.devices_per_node // tp))


def search_tp(costs: LayerCosts, shares: Mapping[int, TpShares], world_size: int, global_batch: int,
              cluster: Cluster, space: SearchSpace = SearchSpace(),
              degrees: Sequence[int] | None = None) -> list[Candidate]:
    """The best `space.keep` candidates over the tp `degrees` (None: 1 and every tp in `shares`), fastest
    first, then the best of each tp not among them; each tp's layouts searched on world / tp ranks with
    `at_tp`'s costs (a tp > 1 without shares is not priced: left out; with none left, tp=1).
    None feasible: the infeasible ones needing the least memory."""
    found: list[Candidate] = []
    errors: list[ConfigError] = []
    wanted = {1, *shares} if degrees is None else {t for t in degrees if t == 1 or t in shares}
    for tp in sorted(wanted or {1}):
        if world_size % tp:
            raise ConfigError(f"tp={tp} does not divide the world size {world_size}; tp must be one of its factors")
        if tp > 1 and not shares[tp].splits:
            continue  # nothing splits: only the same work on fewer lanes
        link = cluster.network.reduce_link(list(range(tp)))
        lane_costs = at_tp(costs, shares[tp], link) if tp > 1 else costs
        lane_cluster = replace(cluster, network=_lanes(cluster.network, tp), ride_sums=cluster.ride_sums and tp == 1)
        try:  # zero=3 beside tp: each rank's part sharded over its replicas, as the runtime runs it
            lanes = search(lane_costs, world_size // tp, global_batch, lane_cluster, space)
        except ConfigError as err:
            errors.append(err)  # the space has no setting on world / tp ranks (ZeRO asked for, no replicas left)
            continue
        found += [replace(c, tp=tp) for c in lanes]
    if not found and errors:
        raise errors[0]
    feasible = sorted((c for c in found if c.feasible), key=lambda c: (float(f"{c.step_time_s:.12g}"), c.tp))
    if not feasible:
        return sorted(found, key=lambda c: c.needed_memory_bytes)[: space.keep]
    top = feasible[: space.keep]
    for c in feasible[space.keep:]:  # each tp's best is listed, so the report shows what every tp costs
        if c.tp not in {t.tp for t in top}:
            top.append(c)
    return top
