"""Every generated program runs under tag-less matching (NCCL): each rank pair's messages are
received in the order they are sent."""

from __future__ import annotations

import pytest

from plait.schedule import SCHEDULES, Action, Op, Program, generate, interleaved
from plait.schedule import forward_only as forward_only_program
from plait.schedule.action import COMPUTE_OPS
from plait.schedule.lower import place_stages


def pair_traffic(
    program: Program, ranks: dict[int, int]
) -> dict[tuple[int, int], tuple[list[str], list[str]]]:
    """(src, dst) -> (the receives src's sends are for, in src's order; dst's receives from src,
    in dst's order): an oracle written apart from the validator's."""
    traffic: dict[tuple[int, int], tuple[list[str], list[str]]] = {}
    for rank, actions in program.items():
        for a in actions:
            s, k = a.stage_index, a.microbatch_index
            if a.op is Op.SEND_F:
                traffic.setdefault((rank, ranks[s + 1]), ([], []))[0].append(f"{s + 1}RF{k}")
            elif a.op is Op.SEND_B:
                traffic.setdefault((rank, ranks[s - 1]), ([], []))[0].append(f"{s - 1}RB{k}")
            elif a.op is Op.RECV_F:
                traffic.setdefault((ranks[s - 1], rank), ([], []))[1].append(str(a))
            elif a.op is Op.RECV_B:
                traffic.setdefault((ranks[s + 1], rank), ([], []))[1].append(str(a))
    return traffic


def check(name: str, num_chunks: int, m: int, forward_only: bool, v: int,
          ranks: dict[int, int] | None) -> None:
    program = generate(name, num_chunks, m, forward_only=forward_only, stage_to_rank=ranks,
                       num_virtual_stages=v)  # validates, the tag-less check included
    if name == "interleaved":
        compute = interleaved(num_chunks, m, v, forward_only=forward_only)
        default = {s: s % (num_chunks // v) for s in range(num_chunks)}
    else:
        compute = (forward_only_program if forward_only else SCHEDULES[name])(num_chunks, m)
        default = {s: s for s in range(num_chunks)}
    placement = ranks or default
    for pair, (sent, received) in pair_traffic(program, placement).items():
        assert sent == received, (name, num_chunks, m, forward_only, v, pair)
    # only receives moved: every rank computes and sends as the schedule says
    placed = place_stages(compute, num_chunks, placement)
    assert {r: [a for a in actions if a.op in COMPUTE_OPS] for r, actions in program.items()} == placed


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1"])
@pytest.mark.parametrize("p", range(2, 5))
@pytest.mark.parametrize("m", range(1, 9))
def test_one_stage_per_rank_schedules(name: str, p: int, m: int) -> None:
    for forward_only in (False, True):
        for ranks in (None, {s: s // 2 for s in range(p)}, {s: p - 1 - s for s in range(p)}):
            check(name, p, m, forward_only, 1, ranks)


@pytest.mark.parametrize("p", range(2, 5))
@pytest.mark.parametrize("v", range(1, 4))
@pytest.mark.parametrize("m", range(1, 9))
def test_interleaved(p: int, v: int, m: int) -> None:
    # p = 2: one rank pair carries activations and gradients both ways; with receives just
    # before their consumers, v >= 2 and odd m >= 5 took them out of send order there
    for forward_only in (False, True):
        for ranks in (None, {s: 10 + s % p for s in range(p * v)}, {s: s for s in range(p * v)}):
            check("interleaved", p * v, m, forward_only, v, ranks)


def test_the_oracle_sees_a_swap() -> None:
    program = generate("gpipe", 2, 2)
    program[1][0], program[1][2] = Action(1, Op.RECV_F, 1), Action(1, Op.RECV_F, 0)
    assert pair_traffic(program, {0: 0, 1: 1})[(0, 1)] == (["1RF0", "1RF1"], ["1RF1", "1RF0"])
