"""Tests for plait.runtime.tensor_parallel's pure parts: a parameter's part on each tp rank (fused
q|k|v blocks included) and the parts joined back, and the rank layout with tp innermost."""

from __future__ import annotations

import pytest
import torch

from plait.plan import Plan
from plait.runtime.tensor_parallel import local_part, whole_of


def test_local_part_takes_each_rank_its_slice_of_every_block() -> None:
    qkv = torch.arange(12.0)  # [q0 q1 | k0 k1 | v0 v1] with 2 features per piece
    assert local_part(qkv, 0, 3, 0, 2).tolist() == [0, 1, 4, 5, 8, 9]
    assert local_part(qkv, 0, 3, 1, 2).tolist() == [2, 3, 6, 7, 10, 11]
    assert local_part(qkv, 0, 1, 1, 2).tolist() == list(range(6, 12))


@pytest.mark.parametrize("dim, blocks, tp", [(0, 1, 2), (1, 3, 2), (1, 1, 4), (0, 2, 4)])
def test_whole_of_joins_the_parts(dim: int, blocks: int, tp: int) -> None:
    t = torch.randn(8 * blocks, 24 * blocks)
    parts = [local_part(t, dim, blocks, r, tp) for r in range(tp)]
    assert all(p.shape[dim] == t.shape[dim] // tp for p in parts)
    assert torch.equal(whole_of(parts, dim, blocks), t)


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
