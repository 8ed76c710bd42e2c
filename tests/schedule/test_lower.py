"""Tests of the lowering passes: stage placement and send/receive insertion."""

from __future__ import annotations

import copy

import pytest

from plait.errors import ScheduleError
from plait.schedule import lower
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


def test_receives_move_up_to_the_peers_send_order() -> None:
    # interleaved 1F1B on 2 ranks, m = 5: rank 1 sends 1SF2 before 3SB1, so rank 0 takes 2RF2
    # before 2RB1 (and 2RF3 before 0RB0, 2RF4 before 0RB1), ahead of the F that needs it;
    # computes and sends keep their places, and rank 1 already receives in send order
    ranks = {s: s % 2 for s in range(4)}
    program = interleaved(4, 5, 2)
    lowered = lower_communication(program, 4, ranks)
    assert lines(lowered) == [
        "rank 0: 0F0 0SF0 0F1 0SF1 2RF0 2F0 2SF0 2RF1 2F1 2SF1 0F2 0SF2 0F3 0SF3 2RB0 2B0 2SB0 "
        "0F4 0SF4 2RF2 2RB1 2B1 2SB1 2F2 2SF2 2RF3 0RB0 0B0 2F3 2SF3 2RF4 0RB1 0B1 2F4 2SF4 "
        "2RB2 2B2 2SB2 2RB3 2B3 2SB3 2RB4 2B4 2SB4 0RB2 0B2 0RB3 0B3 0RB4 0B4",
        "rank 1: 1RF0 1F0 1SF0 1RF1 1F1 1SF1 3RF0 3F0 3RF1 3F1 3B0 3SB0 1RF2 1F2 1SF2 3B1 3SB1 "
        "1RF3 1F3 1SF3 1RB0 1B0 1SB0 1RF4 1F4 1SF4 1RB1 1B1 1SB1 3RF2 3F2 3B2 3SB2 3RF3 3F3 3B3 "
        "3SB3 3RF4 3F4 3B4 3SB4 1RB2 1B2 1SB2 1RB3 1B3 1SB3 1RB4 1B4 1SB4",
    ]
    validate(lowered, 4, 5, ranks)


def test_module_picture_of_send_order_matches_the_code() -> None:
    doc = lower.__doc__ or ""
    pictured = [line.split("...")[1].strip() for line in doc.splitlines()
                if line.startswith("    rank ") and line.count("...") == 2]
    assert len(pictured) == 3
    lowered = lines(lower_communication(interleaved(4, 5, 2), 4, {s: s % 2 for s in range(4)}))
    assert pictured[0] in lowered[1]  # rank 1's sends
    assert pictured[2] in lowered[0]  # rank 0 after the move
    assert pictured[1] not in lowered[0]  # receives placed by their consumers alone
