"""Tests for plait.cost.network: the collective formulas exactly, the link a group of ranks crosses,
the JSON round trip, and links that cannot be."""

from __future__ import annotations

import json
import math

import pytest

from plait.cost.network import (
    Link,
    Network,
    all_gather,
    all_reduce,
    broadcast,
    point_to_point,
    reduce_scatter,
)
from plait.errors import ConfigError


def test_collectives_follow_anchors_formulas() -> None:
    link = Link(latency_s=1e-5, bandwidth=1e9)
    v = 8e6  # bytes per device
    assert point_to_point(v, link) == pytest.approx(1e-5 + 8e-3)
    assert point_to_point(0, link) == 0.0
    assert all_reduce(v, 4, link) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 * v / (4 * 1e9))
    assert all_gather(v, 4, link) == pytest.approx(3 * 1e-5 + 3 * v / 1e9)
    assert reduce_scatter(v, 4, link) == pytest.approx(3 * 1e-5 + 3 * v / (4 * 1e9))
    assert broadcast(v, 8, link) == pytest.approx(3 * (1e-5 + v / 1e9))
    assert all_reduce(v, 1, link) == 0.0  # nothing to reduce with one replica


def test_network_uses_the_slowest_link_crossed() -> None:
    net = Network(Link(1e-6, 100e9), Link(1e-5, 3e9), devices_per_node=4)
    assert net.link([0, 3]).bandwidth == 100e9
    assert net.link([3, 4]).bandwidth == 3e9
    assert Network.from_dict(json.loads(json.dumps(net.to_dict()))) == net
    with pytest.raises(ConfigError, match="bandwidth"):
        Link(1e-6, 0)


def test_formulas_on_round_numbers() -> None:
    # alpha 1 s, B 1 byte/s, V 8 bytes, p 4: every term is an integer
    link = Link(1.0, 1.0)
    assert point_to_point(8, link) == 9.0
    assert all_reduce(8, 4, link) == 2 * 3 * 1 + 2 * 3 * 8 / 4 == 18.0
    assert all_gather(8, 4, link) == 3 + 24 == 27.0
    assert reduce_scatter(8, 4, link) == 3 + 6 == 9.0
    assert broadcast(8, 4, link) == 2 * 9 == 18.0
    assert broadcast(8, 5, link) == 3 * 9  # ceil(log2 5) hops


def test_a_collectives_base_latency_is_paid_once_a_call() -> None:
    # NCCL's model: base + steps x alpha; a point-to-point message pays alpha alone
    link = Link(1.0, 1.0, base_s=5.0)
    assert all_reduce(8, 4, link) == 5 + 18.0
    assert all_gather(8, 4, link) == 5 + 27.0
    assert reduce_scatter(8, 4, link) == 5 + 9.0
    assert broadcast(8, 4, link) == 5 + 18.0
    assert point_to_point(8, link) == 9.0
    assert all_reduce(8, 1, link) == 0.0 and all_reduce(0, 4, link) == 0.0  # no call, no base
    net = Network(link, Link(2.0, 1.0), devices_per_node=2)
    assert Network.from_dict(json.loads(json.dumps(net.to_dict()))) == net
    assert "base_s" not in Link(1.0, 1.0).to_dict()  # a calibrated link's JSON as before
    with pytest.raises(ConfigError, match="base latency per collective.*-1"):
        Link(1.0, 1.0, base_s=-1.0)


@pytest.mark.parametrize("collective", [all_reduce, all_gather, reduce_scatter, broadcast])
def test_nothing_to_move_costs_nothing(collective) -> None:
    link = Link(1.0, 1.0)
    assert collective(8, 1, link) == 0.0  # one device
    assert collective(0, 4, link) == 0.0  # no bytes
    assert point_to_point(-1, link) == 0.0


def test_link_and_reduce_link_of_groups_of_ranks() -> None:
    intra, inter, measured = Link(1e-6, 100e9), Link(1e-5, 3e9), Link(2e-6, 50e9)
    net = Network(intra, inter, devices_per_node=2, reduce_intra=measured)
    assert net.link([0, 1]) is intra and net.link([1, 2]) is inter and net.link([5]) is intra
    assert net.link([]) is intra  # no message crosses a node
    assert net.reduce_link([2, 3]) is measured  # measured as an all-reduce on one node
    assert net.reduce_link([0, 2]) is inter  # none measured between nodes: the point-to-point link


def test_a_library_that_runs_trees_takes_the_faster_of_tree_and_ring() -> None:
    # NCCL's closing all-reduce of a few bytes over 3,072 ranks: a ring pays 2(p-1) steps, a tree
    # 2 ceil(log2 p); a large all-reduce on few ranks stays a ring, and gloo's (no trees) always is
    ring_only, nccl = Link(9.6e-6, 25e9, 8.4e-6), Link(9.6e-6, 25e9, 8.4e-6, tree=True)
    small, p = 64.0, 3072
    assert all_reduce(small, p, ring_only) == pytest.approx(8.4e-6 + 2 * 3071 * 9.6e-6 + 2 * 3071 * small / (p * 25e9))
    assert all_reduce(small, p, nccl) == pytest.approx(8.4e-6 + 24 * (9.6e-6 + small / 25e9))
    assert all_reduce(small, p, nccl) < all_reduce(small, p, ring_only) / 100
    large = 4e9
    assert all_reduce(large, 8, nccl) == all_reduce(large, 8, ring_only)
    assert all_reduce(large, 2, nccl) == all_reduce(large, 2, ring_only)  # the same two steps either way
    data = Network(nccl, nccl, 8).to_dict()
    assert data["intra"]["tree"] is True and Network.from_dict(json.loads(json.dumps(data))).intra == nccl


def test_to_dict_writes_measured_links_only_when_there_are_some() -> None:
    plain = Network(Link(1.0, 2.0), Link(3.0, 4.0), 8)
    assert plain.to_dict() == {"intra": {"latency_s": 1.0, "bandwidth": 2.0},
                               "inter": {"latency_s": 3.0, "bandwidth": 4.0}, "devices_per_node": 8}
    both = Network(Link(1.0, 2.0), Link(3.0, 4.0), 8, reduce_inter=Link(5.0, 6.0))
    assert both.to_dict()["reduce_inter"] == {"latency_s": 5.0, "bandwidth": 6.0}
    assert "reduce_intra" not in both.to_dict()
    assert Network.from_dict(json.loads(json.dumps(both.to_dict()))) == both


@pytest.mark.parametrize("latency, bandwidth, message", [
    (-1e-6, 1e9, "link latency must be a finite time >= 0 s, got -1e-06"),
    (math.inf, 1e9, "link latency must be a finite time >= 0 s, got inf"),
    (0.0, math.nan, "link bandwidth must be a finite number of bytes/s > 0, got nan; for example 3.125e9 "
                    "for 25 Gbit/s"),
    (0.0, -5.0, "link bandwidth must be a finite number of bytes/s > 0, got -5.0; for example 3.125e9 "
                "for 25 Gbit/s"),
])
def test_a_link_that_cannot_be_is_named(latency: float, bandwidth: float, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Link(latency, bandwidth)
    assert str(info.value) == message


def test_devices_per_node_must_be_a_positive_integer() -> None:
    with pytest.raises(ConfigError) as info:
        Network(Link(0.0, 1.0), Link(0.0, 1.0), 0)
    assert str(info.value) == "devices_per_node must be a positive integer, got 0"
