"""Tests for plait.runtime.tp.tensor_parallel's pure parts: the rank layout with tp innermost."""

from __future__ import annotations

import pytest

from plait.plan import Plan


def _plan(pp: int, dp: int, tp: int) -> Plan:
    return Plan(layer_names=tuple("abcd"), layers_per_stage=(4 // pp,) * pp, num_microbatches=1,
                schedule="1f1b", world_size=pp * dp * tp, capture_method="torch.export", dp=dp, tp=tp)


def test_tp_ranks_are_innermost_then_stages_then_replicas() -> None:
    plan = _plan(pp=2, dp=2, tp=2)
    assert [plan.rank_of(0, 0, t) for t in range(2)] == [0, 1]
    assert [plan.rank_of(1, 0, t) for t in range(2)] == [2, 3]
    assert [plan.rank_of(0, 1, t) for t in range(2)] == [4, 5]
    assert [plan.position_of(r) for r in range(8)] == [(0, 0), (0, 0), (1, 0), (1, 0),
                                                        (0, 1), (0, 1), (1, 1), (1, 1)]
    assert [plan.tp_rank_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert plan.stages_of(3) == (1,)
    assert "x tp=2" in str(plan) and "stage 1 (ranks 2-3, 6-7)" in str(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_world_must_divide_by_tp() -> None:
    from plait.errors import ConfigError
    with pytest.raises(ConfigError, match="tp=2"):
        Plan(layer_names=("a",), layers_per_stage=(1,), num_microbatches=1, schedule="1f1b", world_size=3,
             capture_method="torch.export", tp=2)
