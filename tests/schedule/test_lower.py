"""Tests of the lowering passes: stage placement and send/receive insertion."""

from __future__ import annotations

import copy

import pytest

from plait.errors import ScheduleError
from plait.schedule import (
    Program, format_program, forward_only, gpipe, interleaved, lower_communication, one_f_one_b,
    parse_action, validate, zbh1,
)
from plait.schedule.lower import place_stages, resolve_stage_to_rank


def lines(program: Program) -> list[str]:
    return format_program(program).splitlines()


def test_lower_exact_small_case() -> None:
    assert lines(lower_communication(gpipe(3, 2), 3)) == [
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1",
        "rank 1: 1RF0 1F0 1SF0 1RF1 1F1 1SF1 1RB0 1B0 1SB0 1RB1 1B1 1SB1",
        "rank 2: 2RF0 2F0 2RF1 2F1 2B0 2SB0 2B1 2SB1",
    ]
    assert lines(lower_communication(forward_only(2, 1), 2)) == ["rank 0: 0F0 0SF0", "rank 1: 1RF0 1F0"]
    assert lines(lower_communication(gpipe(1, 2), 1)) == ["rank 0: 0F0 0F1 0B0 0B1"]


def test_weight_passes_need_no_communication() -> None:
    assert lines(lower_communication(zbh1(2, 1), 2)) == [
        "rank 0: 0F0 0SF0 0RB0 0B0 0W0",
        "rank 1: 1RF0 1F0 1B0 1SB0 1W0",
    ]


def test_place_interleaved_positions_on_global_ranks() -> None:
    # interleaved keys its program by position r = s % p; a replica offset moves each position
    # whole, keeping its order, and non-adjacent stages of one rank still talk across ranks
    program = interleaved(4, 4, 2)
    offset = {s: 10 + s % 2 for s in range(4)}
    placed = place_stages(program, 4, offset)
    assert placed == {10: program[0], 11: program[1]}
    lowered = lower_communication(placed, 4, offset)
    assert [str(a) for a in lowered[10][:4]] == ["0F0", "0SF0", "0F1", "0SF1"]
    assert "1SF0" in [str(a) for a in lowered[11]] and "2RF0" in [str(a) for a in lowered[10]]
    validate(lowered, 4, 4, offset)


def test_place_splits_a_position_over_ranks() -> None:
    # stage s on rank s for an interleaved program: each rank keeps its stage's actions in the
    # order they had, which only drops ordering constraints and so stays deadlock-free
    program = interleaved(4, 4, 2)
    identity = {s: s for s in range(4)}
    placed = place_stages(program, 4, identity)
    assert placed[2] == [a for a in program[0] if a.stage_index == 2]
    validate(lower_communication(placed, 4, identity), 4, 4, identity)


def test_lower_is_pure() -> None:
    program = one_f_one_b(3, 3)
    before = copy.deepcopy(program)
    lowered = lower_communication(program, 3)
    assert program == before
    assert lowered is not program and lowered[0] is not program[0]


def test_same_rank_pairs_get_no_communication() -> None:
    one_rank = {0: 0, 1: 0, 2: 0}
    placed = place_stages(gpipe(3, 2), 3, one_rank)  # ordered by start cycle, then stage
    assert lines(placed) == ["rank 0: 0F0 0F1 1F0 1F1 2F0 2F1 2B0 1B0 2B1 0B0 1B1 0B1"]
    assert lower_communication(placed, 3, one_rank) == placed
    validate(placed, 3, 2, one_rank)

    split = {0: 0, 1: 1, 2: 1}  # only the 0 -> 1 boundary crosses ranks
    lowered = lower_communication(place_stages(forward_only(3, 1), 3, split), 3, split)
    assert lines(lowered) == ["rank 0: 0F0 0SF0", "rank 1: 1RF0 1F0 2F0"]


def test_place_stages_identity_keeps_order() -> None:
    program = one_f_one_b(4, 5)
    assert place_stages(program, 4) == program
    assert place_stages(program, 4, {0: 3, 1: 2, 2: 1, 3: 0}) == {3 - r: program[r] for r in program}


def test_lower_rejects_misuse() -> None:
    lowered = lower_communication(gpipe(2, 1), 2)
    with pytest.raises(ScheduleError, match="compute-only program .* rank 0 step 1 holds 0SF0; "
                       "lower a program only once"):
        lower_communication(lowered, 2)
    with pytest.raises(ScheduleError, match="rank 1 step 0 holds 1F0, but stage_to_rank puts "
                       "stage 1 on rank 0; call place_stages"):
        lower_communication(gpipe(2, 1), 2, {0: 0, 1: 0})
    with pytest.raises(ScheduleError, match=r"rank 0 step 0 holds 3F0, but there are only 2 "
                       r"stages \(0..1\)"):
        lower_communication({0: [parse_action("3F0")]}, 2)


def test_place_stages_rejects_lowered_or_split_programs() -> None:
    lowered = lower_communication(gpipe(2, 1), 2)
    with pytest.raises(ScheduleError, match="compute-only program of 2 stages, but rank 0 step 1 "
                       "holds 0SF0; pass the program a generator returned"):
        place_stages(lowered, 2, {0: 0, 1: 0})
    with pytest.raises(ScheduleError, match="compute-only program of 2 stages, but rank 0 step 0 "
                       "holds 2F0"):
        place_stages({0: [parse_action("2F0")]}, 2)
    with pytest.raises(ScheduleError, match=r"stage 0 has actions on ranks 0 and 1 \(rank 1 step "
                       r"0: 0F1\); a generator keeps each stage on one rank"):
        place_stages({0: [parse_action("0F0")], 1: [parse_action("0F1")]}, 1)


def test_resolve_stage_to_rank() -> None:
    assert resolve_stage_to_rank(3, None) == {0: 0, 1: 1, 2: 2}
    assert resolve_stage_to_rank(2, {1: 0, 0: 0}) == {0: 0, 1: 0}
    with pytest.raises(ScheduleError, match=r"map every stage 0..2 to a rank, got \{0: 0, 3: 1\} "
                       r"\(missing stages: \[1, 2\], stages that do not exist: \[3\]\)"):
        resolve_stage_to_rank(3, {0: 0, 3: 1})
    with pytest.raises(ScheduleError, match=r"int ranks >= 0, got \{1: -1\}"):
        resolve_stage_to_rank(2, {0: 0, 1: -1})
