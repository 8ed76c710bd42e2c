"""Stages of different widths: each rank's lane and the groups that sum a tied gradient, no processes."""

from plait.plan import Plan
from plait.runtime.widths.stage_widths import lane_ranks, stage_ranks, tie_groups


def plan(stage_tp: tuple[int, ...]) -> Plan:
    names = tuple(f"l{i}" for i in range(len(stage_tp)))
    return Plan(layer_names=names, layers_per_stage=(1,) * len(stage_tp), num_microbatches=2, schedule="1f1b",
                world_size=sum(stage_tp), capture_method="torch.export", stage_tp=stage_tp)


def test_each_rank_runs_its_lane_the_narrow_stage_on_its_last_rank() -> None:
    p = plan((2, 1, 3))
    assert [stage_ranks(p, s) for s in range(3)] == [[0, 1], [2], [3, 4, 5]]
    assert [lane_ranks(p, r) for r in range(6)] == [
        [0, 2, 3], [1, 2, 4], [0, 2, 3], [0, 2, 3], [1, 2, 4], [1, 2, 5]]


def test_a_tie_across_widths_sums_once_with_the_copies_adding_zeros() -> None:
    p = plan((2, 1, 2))
    assert tie_groups(p, [0, 1]) == [([0, 1, 2], [1])]
    assert tie_groups(p, [0, 2]) == [([0, 3], []), ([1, 4], [])]  # one width: per tp rank, as with one tp


def replicas(stage_dp: tuple[int, ...]) -> Plan:
    names = tuple(f"l{i}" for i in range(len(stage_dp)))
    return Plan(layer_names=names, layers_per_stage=(1,) * len(stage_dp), num_microbatches=2, schedule="1f1b",
                world_size=sum(stage_dp), capture_method="torch.export", stage_dp=stage_dp)


def test_each_replica_runs_its_lane_the_narrow_stage_on_its_last_replica() -> None:
    p = replicas((2, 1, 3))
    assert [stage_ranks(p, s) for s in range(3)] == [[0, 1], [2], [3, 4, 5]]
    assert [lane_ranks(p, r) for r in range(6)] == [
        [0, 2, 3], [1, 2, 4], [0, 2, 3], [0, 2, 3], [1, 2, 4], [1, 2, 5]]


def test_a_tie_across_stages_of_different_dp_sums_over_every_replica() -> None:
    p = replicas((2, 1, 2))
    assert tie_groups(p, [0, 1]) == [([0, 1, 2], [])]
    assert tie_groups(p, [0, 2]) == [([0, 1, 3, 4], [])]
