"""Lowering passes on programs: place stages on ranks, then insert the sends and receives.

Both are pure functions from Program to a new Program. Micro-batch 0 crossing from stage 0 on
rank 0 to stage 1 on rank 1 after lowering:

    rank 0 (stage 0):  0F0  0SF0                        0RB0  0B0
                             |  activation                ^
                             v                            |  gradient of stage 1's input
    rank 1 (stage 1):       1RF0  1F0  ...  1B0  1SB0 ----'

so RF sits just before the F that consumes it and SF just after the F that produces it (and
likewise RB / SB around B; W, the weight-gradient half of a split backward, talks to no one).
When both stages live on one rank nothing is inserted: the runtime hands the value over in
memory.

NCCL ignores point-to-point tags: two ranks match their messages in the order they post them,
so a rank must take each peer's messages in the order that peer sends them. Receives just
before their consumers do not always: in interleaved 1F1B on 2 ranks (p = 2, v = 2, m = 5)
the pair rank 1 -> rank 0 carries activations and gradients, and rank 1 sends 1SF2 before
3SB1 while rank 0 runs 2B1, which needs 3SB1's gradient, before 2F2, which needs 1SF2's
activation. The earlier message's receive then moves up to just before the later one's
(`_take_in_send_order`):

    rank 1:  ... 3B0 3SB0 1RF2 1F2 1SF2 3B1 3SB1 ...
    rank 0:  ... 0F4 0SF4 2RB1 2B1 2SB1 2RF2 2F2 ...    placed by its consumers
    rank 0:  ... 0F4 0SF4 2RF2 2RB1 2B1 2SB1 2F2 ...    in rank 1's send order
"""

from __future__ import annotations

from plait.errors import ScheduleError
from plait.schedule.action import COMPUTE_OPS, Action, Op, Program, counterpart
from plait.schedule.timing import clock_cycles

__all__ = ["lower_communication", "place_stages", "check_sizes", "resolve_stage_to_rank"]


def check_sizes(count: int, num_microbatches: int, count_name: str = "num_chunks") -> None:
    """Raise ScheduleError unless both counts (the stages or chunks, and micro-batches) are ints >= 1."""
    for name, value in ((count_name, count), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be an int >= 1, got {value!r}")


def resolve_stage_to_rank(num_chunks: int, stage_to_rank: dict[int, int] | None) -> dict[int, int]:
    """`stage_to_rank` checked to map exactly the stages 0..S-1 to ranks >= 0 (None: stage s
    on rank s)."""
    if stage_to_rank is None:
        return {s: s for s in range(num_chunks)}
    expected = set(range(num_chunks))
    missing = sorted(expected - set(stage_to_rank))
    unknown = sorted(set(stage_to_rank) - expected)
    if missing or unknown:
        raise ScheduleError(
            f"stage_to_rank must map every stage 0..{num_chunks - 1} to a rank, got "
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
    program: Program, num_chunks: int, stage_to_rank: dict[int, int] | None = None
) -> Program:
    """Move each stage's actions from where the generator put them to `stage_to_rank[s]`.

    Generators key their program by pipeline position: stage s at position s (GPipe, 1F1B,
    ZB-H1), or several stages at one position (interleaved: stage s at s % p); each stage sits
    at exactly one position. A rank keeps the order its actions had. A rank that receives the
    actions of several positions runs them in the order of their start cycles in the
    generator's program (`clock_cycles`; ties go to the lower stage). A dependency always
    starts strictly earlier than what needs it, so the merged order keeps every dependency
    ahead of its consumer and adds no deadlock.
    """
    check_sizes(num_chunks, 1)
    ranks = resolve_stage_to_rank(num_chunks, stage_to_rank)
    position_of: dict[int, int] = {}
    for position, actions in sorted(program.items()):
        for step, action in enumerate(actions):
            s = action.stage_index
            if action.op not in COMPUTE_OPS or s >= num_chunks:
                raise ScheduleError(
                    f"place_stages takes a compute-only program of {num_chunks} stages, but "
                    f"rank {position} step {step} holds {action}; pass the program a generator "
                    f"returned"
                )
            if position_of.setdefault(s, position) != position:
                raise ScheduleError(
                    f"stage {s} has actions on ranks {position_of[s]} and {position} (rank "
                    f"{position} step {step}: {action}); a generator keeps each stage on one rank"
                )
    placed: Program = {r: [] for r in sorted(set(ranks.values()))}
    sources: dict[int, set[int]] = {r: set() for r in placed}
    for position, actions in sorted(program.items()):
        for action in actions:
            placed[ranks[action.stage_index]].append(action)
            sources[ranks[action.stage_index]].add(position)
    if any(len(positions) > 1 for positions in sources.values()):
        start = clock_cycles(program, num_chunks)
        for actions in placed.values():
            actions.sort(key=lambda a: (start[a], a.stage_index))
    return placed


def lower_communication(
    program: Program, num_chunks: int, stage_to_rank: dict[int, int] | None = None
) -> Program:
    """Insert RF / SF around each F and RB / SB around each B whose peer stage is on another rank.

    Takes a compute-only program (F, B and W, each on the rank `stage_to_rank` gives its stage)
    and returns a new program; the input is not changed. W needs nothing from another rank.
    Receives then move up where needed so that every rank takes a peer's messages in the order
    the peer sends them (NCCL ignores tags; see the module docstring).
    """
    check_sizes(num_chunks, 1)
    ranks = resolve_stage_to_rank(num_chunks, stage_to_rank)
    lowered: Program = {}
    for rank, actions in program.items():
        out: list[Action] = []
        for step, action in enumerate(actions):
            s, k = action.stage_index, action.microbatch_index
            if action.op not in COMPUTE_OPS:
                raise ScheduleError(
                    f"lower_communication takes a compute-only program (F, B, W), but rank "
                    f"{rank} step {step} holds {action}; lower a program only once"
                )
            if s >= num_chunks:
                raise ScheduleError(
                    f"rank {rank} step {step} holds {action}, but there are only {num_chunks} "
                    f"stages (0..{num_chunks - 1}); generate the program for {num_chunks} stages"
                )
            if ranks[s] != rank:
                raise ScheduleError(
                    f"rank {rank} step {step} holds {action}, but stage_to_rank puts stage {s} "
                    f"on rank {ranks[s]}; call place_stages before lower_communication"
                )
            previous_remote = s > 0 and ranks[s - 1] != rank
            next_remote = s < num_chunks - 1 and ranks[s + 1] != rank
            if action.op is Op.WEIGHT:
                out.append(action)
            elif action.op is Op.FORWARD:
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
    return _take_in_send_order(lowered, ranks)


def _take_in_send_order(program: Program, ranks: dict[int, int]) -> Program:
    """Move receives up so that each rank takes each peer's messages in the peer's send order.

    A receive whose message the peer sends after others not yet taken gets those others'
    receives just before it. Only receives move, and only earlier, so each still precedes
    its consumer; and a moved receive waits for a send its peer makes before the send the
    following receive already waits for, so no deadlock is added.
    """
    sent: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> dst's receives, in send order
    for src, actions in program.items():
        for a in actions:
            if a.op in (Op.SEND_F, Op.SEND_B):
                receive = counterpart(a)
                sent.setdefault((src, ranks[receive.stage_index]), []).append(receive)
    place = {a: (pair, i) for pair, queue in sent.items() for i, a in enumerate(queue)}
    taken = {pair: 0 for pair in sent}  # messages of each (src, dst) taken so far
    ordered: Program = {}
    for dst, actions in program.items():
        out: list[Action] = []
        for a in actions:
            if a not in place:  # compute or send
                out.append(a)
                continue
            pair, i = place[a]
            if i >= taken[pair]:  # not yet taken ahead of a later message
                out += sent[pair][taken[pair] : i + 1]
                taken[pair] = i + 1
        ordered[dst] = out
    return ordered
