"""Stages of different widths (`Plan.stage_tp`, `Plan.stage_dp`): each rank's groups, peers, crossings and tied sums.

At stage_tp = (2, 1), 1F1B, stage 0 on ranks 0 1, stage 1 on rank 2 (with dp = 2 a second pipeline
on ranks 3 4 | 5, alike; each stage's ranks all-reduce their gradients with the other replica's)::

    rank 0  F0 -tile 0-> rank 2            rank 2 <-tile 0- rank 0, <-tile 1- rank 1: whole, F0, B0
    rank 1  F0 -tile 1-> rank 2            rank 2 -tile 0-> rank 0, -tile 1-> rank 1 (gradients)
    rank 0 1: all-gather the gradient's tiles (their tp group), B0

Every rank makes every stage's tp group, in stage order. Each rank runs the program of a
uniform pipeline's "lane" (`lane_ranks`); only the messages across a boundary of two widths go
through a `Crossing`. A parameter tied across stages of different widths (a word embedding and
its LM head) stays whole on each (`kept_whole`), and its gradient is summed once over all its
ranks, each stage's tp rank 0 adding it and the others (which hold the same value) zeros.

Stages of different dp widths (`stage_dp`, tp = 1) are laid out alike, a stage's replicas in
place of its tp ranks: at stage_dp = (2, 1) rank 0 and rank 1 each run the lane of a two-stage
pipeline with rank 2, whose own lane is rank 0's; the boundary goes through a `RowCrossing`
(each replica sends its rows), and a tied parameter's gradient is summed over every replica of
every stage that holds it (each replica's share of the rows is scaled as plain dp scales it).
"""

from __future__ import annotations

import glob
from typing import Any, Sequence

from plait.capture.split import StageModule
from plait.capture.tp_layout import module_of
from plait.plan import Plan
from plait.runtime.comm.collectives import make_group
from plait.runtime.widths.crossing import Crossing
from plait.runtime.widths.row_crossing import RowCrossing, batch_major

__all__ = ["stage_ranks", "stage_group", "lane_ranks", "crossings", "tie_groups", "kept_whole"]


def stage_ranks(plan: Plan, stage_index: int, replica: int = 0) -> list[int]:
    """The ranks of one stage of pipeline replica `replica`, in tp order (with stage_dp: the
    stage's replicas, in order)."""
    if plan.stage_dp:
        return list(plan.mesh.replica_ranks(stage_index))
    return list(plan.mesh.stage_ranks(stage_index, replica))


def stage_group(plan: Plan, rank: int) -> Any:
    """This rank's stage's tp group (None: its stage has one rank); every rank makes every group,
    replica by replica."""
    groups = {ranks: make_group(ranks) for ranks in plan.mesh.tp_groups()}
    return groups.get(plan.mesh.tp_ranks(rank))


def lane_ranks(plan: Plan, rank: int) -> list[int]:
    """The rank of each stage on this rank's lane: its own tp rank and replica, or the last of a
    narrower stage (the schedule's programs are made on it; the crossings replace its peers where
    widths differ)."""
    return list(plan.mesh.lane_ranks(rank))


def crossings(plan: Plan, rank: int, group: Any,
              stages: Sequence[StageModule]) -> dict[int, Crossing | RowCrossing]:
    """The crossings of this rank's stages' boundaries with a stage of another width, by boundary."""
    out: dict[int, Crossing | RowCrossing] = {}
    replica = plan.position_of(rank)[1]
    for s in plan.stages_of(rank):
        for boundary in (s - 1, s):
            if not 0 <= boundary < plan.num_chunks - 1:
                continue
            sides = stage_ranks(plan, boundary, replica), stage_ranks(plan, boundary + 1, replica)
            if plan.dp_of(boundary) != plan.dp_of(boundary + 1):
                out[boundary] = RowCrossing(boundary, *sides, rank, batch_major(stages[boundary].module))
            elif plan.tp_of(boundary) != plan.tp_of(boundary + 1):
                out[boundary] = Crossing(boundary, *sides, rank, group, whole=plan.crossing == "whole")
    return out


def tie_groups(plan: Plan, holders: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """(ranks summing a tied parameter's gradient, the ranks among them that add zeros) for the
    stages `holders`: per tp rank when their widths agree, else one sum over all their ranks."""
    widths = {plan.tp_of(s) for s in holders}
    if len(widths) == 1:
        return [(list(dict.fromkeys(r for s in holders for r in plan.mesh.replica_ranks(s, t))), [])
                for t in range(widths.pop())]
    ranks = [r for replica in range(plan.dp) for s in holders for r in stage_ranks(plan, s, replica)]
    return [(ranks, [r for r in ranks if plan.tp_rank_of(r) > 0])]


def kept_whole(stages: Sequence[StageModule], plan: Plan) -> dict[int, list[str]]:
    """Per stage: tp_plan patterns ("replicate") of the modules whose parameters are tied to a stage
    of another width (a split one could not be summed with a whole one)."""
    holders: dict[int, set[int]] = {}
    for st in stages:
        for p in st.module.parameters():
            holders.setdefault(id(p), set()).add(st.stage_index)
    across = {i for i, ss in holders.items() if len({plan.tp_of(s) for s in ss}) > 1}
    out: dict[int, list[str]] = {}
    for st in stages:
        for node in st.module.graph.nodes:
            if node.op == "get_attr" and isinstance(node.target, str):
                try:
                    param = st.module.get_parameter(node.target)
                except AttributeError:
                    continue
                if id(param) in across:
                    out.setdefault(st.stage_index, []).append(glob.escape(module_of(node.target)))
    return {s: sorted(set(patterns)) for s, patterns in out.items()}
