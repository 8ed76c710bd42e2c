"""Lowering passes on programs: place stages on ranks, then insert the sends and receives.

Both are pure functions from Program to a new Program. Micro-batch 0 crossing from stage 0 on
rank 0 to stage 1 on rank 1 after lowering:

    rank 0 (stage 0):  0F0  0SF0                        0RB0  0B0
                             |  activation                ^
                             v                            |  gradient of stage 1's input
    rank 1 (stage 1):       1RF0  1F0  ...  1B0  1SB0 ----'

so RF sits just before the F that consumes it and SF just after the F that produces it (and
likewise RB / SB around B). When both stages live on one rank nothing is inserted: the runtime
hands the value over in memory.
"""

from __future__ import annotations

from plait.errors import ScheduleError
from plait.schedule.action import Action, Op, Program
from plait.schedule.timing import clock_cycles

__all__ = ["lower_communication", "place_stages", "check_sizes", "resolve_stage_to_rank"]


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    """Raise ScheduleError unless both counts are ints >= 1."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be an int >= 1, got {value!r}")


def resolve_stage_to_rank(num_stages: int, stage_to_rank: dict[int, int] | None) -> dict[int, int]:
    """`stage_to_rank` checked to map exactly the stages 0..p-1 to ranks >= 0 (None: stage s
    on rank s)."""
    if stage_to_rank is None:
        return {s: s for s in range(num_stages)}
    expected = set(range(num_stages))
    missing = sorted(expected - set(stage_to_rank))
    unknown = sorted(set(stage_to_rank) - expected)
    if missing or unknown:
        raise ScheduleError(
            f"stage_to_rank must map every stage 0..{num_stages - 1} to a rank, got "
            f"{stage_to_rank} (missing stages: {missing}, stages that do not exist: {unknown})"
        )
    bad = {
        s: r for s, r in stage_to_rank.items()
        if not isinstance(r, int) or isinstance(r, bool) or r < 0
    }
    if bad:
        raise ScheduleError(f"stage_to_rank must give int ranks >= 0, got {bad}")
    return dict(sorted(stage_to_rank.items()))


def place_stages(
    program: Program, num_stages: int, stage_to_rank: dict[int, int] | None = None
) -> Program:
    """Move each stage's actions from rank s (as generators emit them) to `stage_to_rank[s]`.

    A rank that receives several stages runs their actions in the order of their start cycles
    when every stage had a rank of its own (`clock_cycles`; ties go to the lower stage).
    A dependency always starts strictly earlier than what needs it, so the merged order keeps
    every dependency ahead of its consumer and adds no deadlock.
    """
    check_sizes(num_stages, 1)
    ranks = resolve_stage_to_rank(num_stages, stage_to_rank)
    for rank, actions in program.items():
        for step, action in enumerate(actions):
            if action.stage_index != rank or rank >= num_stages:
                raise ScheduleError(
                    f"place_stages takes a program with stage s on rank s and {num_stages} "
                    f"stages, but rank {rank} step {step} holds {action}; pass the program a "
                    f"generator returned"
                )
    placed: Program = {r: [] for r in sorted(set(ranks.values()))}
    for stage in sorted(program):
        if stage < num_stages:  # a higher rank holds nothing, as checked above
            placed[ranks[stage]].extend(program[stage])
    if len(placed) < num_stages:  # some rank holds several stages: merge by clock cycle
        start = clock_cycles(program, num_stages)
        for actions in placed.values():
            actions.sort(key=lambda a: (start[a], a.stage_index))
    return placed


def lower_communication(
    program: Program, num_stages: int, stage_to_rank: dict[int, int] | None = None
) -> Program:
    """Insert RF / SF around each F and RB / SB around each B whose peer stage is on another rank.

    Takes a compute-only program (F and B, each on the rank `stage_to_rank` gives its stage)
    and returns a new program; the input is not changed.
    """
    check_sizes(num_stages, 1)
    ranks = resolve_stage_to_rank(num_stages, stage_to_rank)
    lowered: Program = {}
    for rank, actions in program.items():
        out: list[Action] = []
        for step, action in enumerate(actions):
            s, k = action.stage_index, action.microbatch_index
            if action.op not in (Op.FORWARD, Op.BACKWARD):
                raise ScheduleError(
                    f"lower_communication takes a compute-only program (F and B), but rank "
                    f"{rank} step {step} holds {action}; lower a program only once"
                )
            if s >= num_stages:
                raise ScheduleError(
                    f"rank {rank} step {step} holds {action}, but there are only {num_stages} "
                    f"stages (0..{num_stages - 1}); generate the program for {num_stages} stages"
                )
            if ranks[s] != rank:
                raise ScheduleError(
                    f"rank {rank} step {step} holds {action}, but stage_to_rank puts stage {s} "
                    f"on rank {ranks[s]}; call place_stages before lower_communication"
                )
            previous_remote = s > 0 and ranks[s - 1] != rank
            next_remote = s < num_stages - 1 and ranks[s + 1] != rank
            if action.op is Op.FORWARD:
                if previous_remote:
                    out.append(Action(s, Op.RECV_F, k))
                out.append(action)
                if next_remote:
                    out.append(Action(s, Op.SEND_F, k))
            else:
                if next_remote:
                    out.append(Action(s, Op.RECV_B, k))
                out.append(action)
                if previous_remote:
                    out.append(Action(s, Op.SEND_B, k))
        lowered[rank] = out
    return lowered
