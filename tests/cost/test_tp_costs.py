"""Tests for plait.cost.tp_costs: a layer's costs on one of tp ranks (split work and memory over tp,
the collectives' ring times added), the tp degrees of a node, and the search over tp choosing tp
where it pays (a fast link, a model too large for one device) and not where it does not."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster
from plait.cost.tp_costs import TpShares, at_tp
from plait.errors import ConfigError
from plait.search.search import SearchSpace, format_table
from plait.search.tp_degree import search_tp, tp_degrees
from tests.plan.factory import layer_costs

FAST = Link(0.0, 1e30)


def shares(n: int, tp: int, share: float = 1.0, split: float = 100.0, fwd: float = 0.0, bwd: float = 0.0,
           gather: float = 0.0, count: float = 0.0) -> TpShares:
    return TpShares(tp, (split,) * n, (share,) * n, (fwd,) * n, (bwd,) * n, (gather,) * n, (count,) * n, (count,) * n)


def test_split_work_and_memory_divide_by_tp_and_the_whole_part_stays() -> None:
    costs = layer_costs(2, forward=4.0, backward=8.0, weight=2.0, activation=10.0, params=100.0, optimizer=1.0,
                        fixed=0.5, weight_fixed=0.5)
    half = at_tp(costs, shares(2, 2, share=0.5, split=60.0), FAST)
    assert half.forward_row_s == (3.0, 3.0)  # 4 x (0.5 + 0.5 / 2)
    assert half.backward_row_s == (6.0, 6.0) and half.weight_row_s == (1.5, 1.5)
    assert half.forward_fixed_s == (0.375, 0.375)  # a small batch's time is its weights': they split too
    assert half.weight_fixed_s == (0.35, 0.35)  # W's fixed part (the gradient's accumulation) as the parameters
    assert half.activation_row_bytes == (7.5, 7.5)
    assert half.param_bytes == (70.0, 70.0) and half.grad_bytes == (70.0, 70.0)  # 40 whole + 60 / 2
    assert half.optimizer_s == (0.7, 0.7)
    assert at_tp(costs, shares(2, 1), FAST) is costs


def test_collectives_follow_the_ring_formulas() -> None:
    link = Link(1e-5, 1e9)
    costs = layer_costs(1, forward=1.0, backward=1.0, fixed=0.0)
    four = at_tp(costs, shares(1, 4, share=0.0, split=0.0, fwd=1e6, bwd=2e6, gather=4e6, count=1), link)
    all_reduce = lambda v: 2 * 3 * 1e-5 + 2 * 3 / 4 * v / 1e9  # noqa: E731
    assert four.forward_fixed_s[0] == pytest.approx(6e-5)
    assert four.forward_row_s[0] == pytest.approx(1.0 + all_reduce(1e6) - 6e-5 + 3 / 4 * 4e6 / 1e9)
    assert four.backward_row_s[0] == pytest.approx(1.0 + all_reduce(2e6) - 6e-5)


def test_tp_degrees_are_powers_of_two_within_a_node_that_divide_the_world() -> None:
    assert tp_degrees(8, 8) == (1, 2, 4, 8)
    assert tp_degrees(16, 8) == (1, 2, 4, 8)
    assert tp_degrees(12, 8) == (1, 2, 4)
    assert tp_degrees(6, 2) == (1, 2)
    assert tp_degrees(3, 8) == (1,)
    assert tp_degrees(16, 16, limit=8) == (1, 2, 4, 8)


def _cluster(link: Link, memory: float = math.inf, per_node: int = 4) -> Cluster:
    return Cluster(Network(link, link, per_node), memory, optimizer_state_factor=0.0)


SPACE = SearchSpace(schedules=("1f1b",), recompute=(False,), batch_weight_grads=(False,), keep=20, simulate_top=0)


def test_tp_wins_on_a_free_link_and_loses_on_a_slow_one() -> None:
    costs = layer_costs(1, forward=1.0, backward=2.0)  # one layer: pp cannot split it; a batch of 1 row: nor dp
    options = {2: shares(1, 2, fwd=1e6, bwd=1e6, count=1), 4: shares(1, 4, fwd=1e6, bwd=1e6, count=1)}
    fast = search_tp(costs, options, 4, 1, _cluster(FAST), SPACE)
    assert fast[0].tp == 4 and fast[0].step_time_s == pytest.approx(0.75)
    assert [c.tp for c in fast] == [4, 2, 1]
    slow = search_tp(costs, options, 4, 1, _cluster(Link(1.0, 1e3)), SPACE)
    assert slow[0].tp == 1
    one = search_tp(costs, options, 4, 1, _cluster(Link(1.0, 1e3)), SearchSpace(keep=1, simulate_top=0))
    assert [c.tp for c in one] == [1, 2, 4]  # beyond `keep`, each tp's best is still listed
    only = search_tp(costs, options, 4, 1, _cluster(Link(1.0, 1e3)), SPACE, degrees=(2, 8))
    assert {c.tp for c in only} == {2}  # the degrees asked for; 8 has no shares: not priced
    assert {c.tp for c in search_tp(costs, options, 4, 1, _cluster(FAST), SPACE, degrees=(8,))} == {1}
    assert " 4 " in format_table(fast).splitlines()[1]  # the tp column
    assert fast[0].to_dict()["tp"] == 4


def test_a_model_no_device_holds_whole_runs_split() -> None:
    costs = layer_costs(1, params=100.0)
    found = search_tp(costs, {2: shares(1, 2, split=100.0)}, 2, 4, _cluster(FAST, memory=120.0), SPACE)
    assert found[0].feasible and found[0].tp == 2
    assert found[0].prediction is not None and found[0].prediction.peak_memory_bytes == pytest.approx(100.0)  # 50 + grads 50
    alone = search_tp(costs, {}, 2, 4, _cluster(FAST, memory=120.0), SPACE)  # 100 + 100 whole
    assert not alone[0].feasible and "tensor parallelism" in alone[0].reason


def test_a_layout_that_splits_nothing_is_not_a_candidate_and_bad_shares_are_refused() -> None:
    costs = layer_costs(2)
    found = search_tp(costs, {2: shares(2, 2, share=0.0, split=0.0)}, 2, 4, _cluster(FAST), SPACE)
    assert {c.tp for c in found} == {1}
    with pytest.raises(ConfigError, match="TpShares has 1 layers, the costs 2"):
        at_tp(costs, shares(1, 2), FAST)
    with pytest.raises(ConfigError, match="are shares"):
        shares(1, 2, share=1.5)
    with pytest.raises(ConfigError, match="tp=4 does not divide the world size 6"):
        search_tp(costs, {4: shares(2, 4)}, 6, 4, _cluster(FAST), SPACE)
    assert TpShares.from_dict(shares(2, 2).to_dict()) == shares(2, 2)


def test_zero3_is_searched_beside_tp_as_its_runtime_runs_it() -> None:
    """Four layers of 100 bytes (and as many of gradients, Adam's state twice that) on 4 devices:
    one stage on 4 replicas holds 250 a layer at ZeRO-1/2 and 175 at zero=3 (the parameters a
    quarter too). With each layer split whole at tp=2, 2 replicas hold 150 a layer at ZeRO-1/2 and
    125 at zero=3 (tp's part, half of it on each replica: the runtime's FSDP2 over each tp part):
    on 560 bytes only tp=2 at zero=3 fits; with 10 of each layer's bytes split (95 a part), tp=2
    at zero=3 holds 190 a layer and only tp=1 at zero=3 fits 800."""
    costs = layer_costs(4, forward=1e-3, backward=2e-3, params=100.0, optimizer=1e-3)
    cluster = Cluster(Network(Link(1e-5, 1e6), Link(1e-5, 1e6), 1), 560.0)
    found = search_tp(costs, {2: shares(4, 2, split=100.0, count=1)}, 4, 8, cluster, SearchSpace(pp=(1,), keep=50))
    assert found[0].feasible and all(c.tp == 2 and c.setting.zero == 3 for c in found), found[0].reason
    assert found[0].prediction is not None and found[0].prediction.parameter_bytes[0] == 4 * 25.0
    roomy = replace(cluster, memory_bytes=800.0)
    found = search_tp(costs, {2: shares(4, 2, split=10.0, count=1)}, 4, 8, roomy, SearchSpace(pp=(1,), keep=50))
    assert found[0].feasible and found[0].tp == 1 and found[0].setting.zero == 3
