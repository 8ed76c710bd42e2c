"""Tests of the validator: it accepts every generated program and explains each rejection."""

from __future__ import annotations

import pytest

from plait.errors import ScheduleError
from plait.schedule import (
    SCHEDULES, Program, forward_only, generate, gpipe, lower_communication, parse_action,
    validate, zbh1,
)


def program_of(**rows: str) -> Program:
    """`program_of(r0="0F0 0SF0", r1="1RF0 1F0")` -> {0: [...], 1: [...]}."""
    return {int(name[1:]): [parse_action(t) for t in text.split()] for name, text in rows.items()}


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 10))
def test_accepts_every_generated_program(p: int, m: int) -> None:
    for name in SCHEDULES:
        validate(generate(name, p, m), p, m)
        validate(generate(name, p, m, forward_only=True), p, m, forward_only=True)
    # compute-only programs are valid too when every stage shares one rank
    one_rank = {s: 0 for s in range(p)}
    validate(generate("1f1b", p, m, stage_to_rank=one_rank), p, m, one_rank)
    pairs = {s: s // 2 for s in range(p)}
    validate(generate("gpipe", p, m, stage_to_rank=pairs), p, m, pairs)


@pytest.mark.parametrize("p, v", [(1, 2), (2, 2), (3, 3), (4, 2)])
@pytest.mark.parametrize("m", range(1, 10))
def test_accepts_interleaved_programs(p: int, v: int, m: int) -> None:
    ranks = {s: s % p for s in range(p * v)}
    validate(generate("interleaved", p * v, m, num_virtual_stages=v), p * v, m, ranks)
    with pytest.raises(ScheduleError, match="belongs to stage"):  # the placement matters
        validate(generate("interleaved", p * v, m, num_virtual_stages=v), p * v, m)


def test_weight_pass_needs_its_backward_first() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0 step 1: 0W0 comes before 0B0 \(step 2\), "
                       r"which it needs; move 0W0 after 0B0"):
        validate(program_of(r0="0F0 0W0 0B0"), 1, 1)
    validate(program_of(r0="0F0 0B0 0W0"), 1, 1)


def test_split_program_needs_every_weight_pass() -> None:
    # a program with any W splits every backward: a B without its W is an error
    with pytest.raises(ScheduleError) as info:
        validate(program_of(r0="0F0 0F1 0B0 0W0 0B1"), 1, 2)
    message = str(info.value)
    assert ("missing compute actions (each of the 1 stages runs each of the 2 micro-batches "
            "forward, input-gradient (B) and weight-gradient (W) backward exactly once") in message
    assert "  0W1 on rank 0" in message
    with pytest.raises(ScheduleError, match="0W0 occurs twice"):
        validate(program_of(r0="0F0 0B0 0W0 0W0"), 1, 1)
    with pytest.raises(ScheduleError, match="0W0 is a backward action in a forward-only program"):
        validate(program_of(r0="0F0 0W0"), 1, 1, forward_only=True)


def test_dry_run_with_weight_passes() -> None:
    program = lower_communication(zbh1(2, 2), 2)
    validate(program, 2, 2)
    # rank 1 postpones its first B behind a W that needs it: a local order error
    program[1] = [parse_action(t) for t in "1RF0 1F0 1W0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1W1".split()]
    with pytest.raises(ScheduleError, match="1W0 comes before 1B0"):
        validate(program, 2, 2)
    # rank 0 waits for micro-batch 1's gradient before sending micro-batch 1's activation
    program = lower_communication(zbh1(2, 2), 2)
    program[0] = [parse_action(t) for t in "0F0 0SF0 0F1 0RB1 0SF1 0RB0 0B0 0W0 0B1 0W1".split()]
    with pytest.raises(ScheduleError, match="deadlock: no rank can progress"):
        validate(program, 2, 2)


def test_deadlock_when_both_ranks_receive_first() -> None:
    program = program_of(r0="0RB0 0F0 0SF0 0B0", r1="1RF0 1F0 1B0 1SB0")
    with pytest.raises(ScheduleError) as info:
        validate(program, 2, 1)
    message = str(info.value)
    assert message.startswith("deadlock: no rank can progress after 0 of 8 actions "
                              "(num_chunks=2, num_microbatches=1)")
    assert ("rank 0 is blocked at step 0 on 0RB0, waiting for 1SB0 on rank 1 "
            "(rank 1 is blocked at step 0 on 1RF0)") in message
    assert ("rank 1 is blocked at step 0 on 1RF0, waiting for 0SF0 on rank 0 "
            "(rank 0 is blocked at step 0 on 0RB0)") in message
    assert "rank 0 |[0RB0]  0F0" in message and "rank 1 |[1RF0]  1F0" in message


def test_deadlock_midway_shows_every_rank_and_its_position() -> None:
    # rank 1 holds back the activation of micro-batch 1 until it has the gradient of
    # micro-batch 0, but GPipe's last rank wants both forwards before its first backward
    program = lower_communication(gpipe(3, 2), 3)
    program[1] = [parse_action(t) for t in
                  "1RF0 1F0 1SF0 1RF1 1F1 1RB0 1B0 1SB0 1SF1 1RB1 1B1 1SB1".split()]
    program[3] = []  # a rank without stages has nothing to wait for
    with pytest.raises(ScheduleError) as info:
        validate(program, 3, 2)
    message = str(info.value)
    assert "deadlock: no rank can progress after 11 of 28 actions" in message
    assert ("rank 0 is blocked at step 4 on 0RB0, waiting for 1SB0 on rank 1 "
            "(rank 1 is blocked at step 5 on 1RB0)") in message
    assert ("rank 1 is blocked at step 5 on 1RB0, waiting for 2SB0 on rank 2 "
            "(rank 2 is blocked at step 2 on 2RF1)") in message
    assert ("rank 2 is blocked at step 2 on 2RF1, waiting for 1SF1 on rank 1 "
            "(rank 1 is blocked at step 5 on 1RB0)") in message
    assert "rank 3 has finished" in message
    assert "[0RB0]" in message and "[1RB0]" in message and "[2RF1]" in message
    assert message.count("[") == 3 and "rank 3 | (done)" in message


def test_missing_receive() -> None:
    program = lower_communication(gpipe(2, 2), 2)
    program[1].remove(parse_action("1RF0"))
    with pytest.raises(ScheduleError) as info:
        validate(program, 2, 2)
    message = str(info.value)
    assert ("rank 0 step 1: 0SF0 has no matching receive 1RF0 on rank 1; add it there "
            "(lower_communication does)") in message
    assert "rank 1 step 0: 1F0 needs 1RF0 on rank 1, which is missing" in message


def test_missing_send() -> None:
    program = lower_communication(gpipe(2, 1), 2)
    program[1].remove(parse_action("1SB0"))
    with pytest.raises(ScheduleError, match="rank 0 step 2: 0RB0 has no matching send 1SB0 on "
                       "rank 1"):
        validate(program, 2, 1)


def test_duplicated_forward() -> None:
    program = lower_communication(gpipe(2, 2), 2)
    program[0].append(parse_action("0F1"))
    with pytest.raises(ScheduleError, match=r"duplicated actions:\n  0F1 occurs twice, at rank 0 "
                       r"step 2 and rank 0 step 8; keep one"):
        validate(program, 2, 2)


def test_backward_before_its_forward() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0 step 0: 0B0 comes before 0F0 \(step 1\), "
                       r"which it needs; move 0B0 after 0F0"):
        validate(program_of(r0="0B0 0F0"), 1, 1)


def test_send_before_its_compute() -> None:
    program = program_of(r0="0SF0 0F0", r1="1RF0 1F0")
    with pytest.raises(ScheduleError, match=r"0SF0 comes before 0F0 \(step 1\)"):
        validate(program, 2, 1, forward_only=True)


def test_action_on_the_wrong_rank() -> None:
    program = lower_communication(forward_only(2, 1), 2)
    program[0].append(program[1].pop())  # 1F0 onto rank 0
    with pytest.raises(ScheduleError, match=r"actions in the wrong place:\n  rank 0 step 2: 1F0 "
                       r"belongs to stage 1 on rank 1; move it there"):
        validate(program, 2, 1, forward_only=True)


def test_missing_compute() -> None:
    program = program_of(r0="0F0 0F1 0B0")
    with pytest.raises(ScheduleError) as info:
        validate(program, 1, 2)
    assert "missing compute actions" in str(info.value)
    assert "  0B1 on rank 0" in str(info.value)


def test_out_of_range_and_forward_only_rules() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0 step 1: 0F2 names micro-batch 2, but "
                       r"micro-batches are 0..1"):
        validate(program_of(r0="0F0 0F2"), 1, 2, forward_only=True)
    with pytest.raises(ScheduleError, match=r"rank 2 step 0: 2F0 names stage 2, but stages "
                       r"are 0..1"):
        validate({0: [], 1: [], 2: [parse_action("2F0")]}, 2, 1)
    with pytest.raises(ScheduleError, match="0B0 is a backward action in a forward-only program"):
        validate(program_of(r0="0F0 0B0"), 1, 1, forward_only=True)
    with pytest.raises(ScheduleError, match="0RF0 talks to stage -1, which does not exist"):
        validate(program_of(r0="0RF0 0F0"), 1, 1, forward_only=True)


def test_communication_between_stages_on_one_rank() -> None:
    one_rank = {0: 0, 1: 0}
    program = program_of(r0="0F0 0SF0 1RF0 1F0")
    with pytest.raises(ScheduleError, match="0SF0 talks to stage 1 on the same rank 0; the value "
                       "is handed over in memory, drop 0SF0 and 1RF0"):
        validate(program, 2, 1, one_rank, forward_only=True)


def test_many_problems_are_counted() -> None:
    program = {0: [parse_action(f"0F{k}") for k in range(20)] * 2}
    with pytest.raises(ScheduleError, match=r"\.\.\. and 8 more"):
        validate(program, 1, 20, forward_only=True)


def test_bad_sizes() -> None:
    with pytest.raises(ScheduleError, match="num_microbatches must be an int >= 1, got 0"):
        validate(gpipe(1, 1), 1, 0)


def test_receives_out_of_send_order() -> None:
    # rank 1 takes micro-batch 1's activation first: tags (gloo) would match it, NCCL (which
    # matches two ranks' messages in the order posted) would hand it micro-batch 0's
    program = program_of(r0="0F0 0SF0 0F1 0SF1", r1="1RF1 1RF0 1F0 1F1")
    with pytest.raises(ScheduleError) as info:
        validate(program, 2, 2, forward_only=True)
    assert str(info.value) == (
        "messages taken out of send order (NCCL ignores tags and matches the messages between "
        "two ranks in the order they are posted; each rank must receive a peer's messages in "
        "the order the peer sends them):\n"
        "  rank 0 -> rank 1, message 0: rank 0 step 1 sends 0SF0, but rank 1 step 0 receives "
        "1RF1 (expected 1RF0); move 1RF0 ahead of 1RF1 on rank 1, or reorder rank 0's sends "
        "(lower_communication does the first)"
    )
    validate(program_of(r0="0F0 0SF0 0F1 0SF1", r1="1RF0 1RF1 1F0 1F1"), 2, 2, forward_only=True)


def test_interleaved_on_two_ranks_before_receives_followed_send_order() -> None:
    # The story of the bug: interleaved 1F1B on 2 ranks (v = 2, m = 5) placed each receive
    # just before its consumer, so rank 0 took 3SB1's gradient (for 2B1) before 1SF2's
    # activation (for 2F2), which rank 1 sends first. The dry run, which matches by name
    # like tags, passed it; under NCCL 2RB1 would have received the activation.
    ranks = {s: s % 2 for s in range(4)}
    program = generate("interleaved", 4, 5, num_virtual_stages=2)
    text = " ".join(str(a) for a in program[0])
    assert "0F4 0SF4 2RF2 2RB1 2B1 2SB1 2F2" in text
    program[0] = [parse_action(t) for t in
                  text.replace("2RF2 2RB1 2B1 2SB1 2F2", "2RB1 2B1 2SB1 2RF2 2F2").split()]
    with pytest.raises(ScheduleError) as info:
        validate(program, 4, 5, ranks)
    assert str(info.value).splitlines()[1] == (
        "  rank 1 -> rank 0, message 3: rank 1 step 14 sends 1SF2, but rank 0 step 19 receives "
        "2RB1 (expected 2RF2); move 2RF2 ahead of 2RB1 on rank 0, or reorder rank 1's sends "
        "(lower_communication does the first)"
    )


def test_out_of_order_gradients_count_per_pair() -> None:
    # one problem per rank pair: the first position where the sequences part
    program = lower_communication(gpipe(3, 2), 3)
    program[0] = [parse_action(t) for t in "0F0 0SF0 0F1 0SF1 0RB1 0RB0 0B0 0B1".split()]
    program[1] = [parse_action(t) for t in
                  "1RF1 1RF0 1F0 1SF0 1F1 1SF1 1RB0 1B0 1SB0 1RB1 1B1 1SB1".split()]
    with pytest.raises(ScheduleError) as info:
        validate(program, 3, 2)
    problems = str(info.value).splitlines()[1:]
    assert [p.split(":")[0] for p in problems] == [
        "  rank 0 -> rank 1, message 0", "  rank 1 -> rank 0, message 0",
    ]
