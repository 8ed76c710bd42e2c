"""Validation of a lowered program: static checks, then a one-process dry run that finds deadlocks.

The dry run models the runtime's rules: a rank executes its list in order; a send never
blocks; a receive completes only after the peer rank has executed the matching send; F and B
wait for the values they consume (a receive on this rank, or the producing F/B of a stage on
the same rank); W waits for the B of its stage and micro-batch, on its own rank.

The dry run matches a receive to its send by name, as tags do on gloo. NCCL ignores tags and
matches the messages between two ranks in the order they are posted, so a last check asks
that every rank take each peer's messages in the order the peer sends them.
"""

from __future__ import annotations

from plait.errors import ScheduleError
from plait.schedule.action import COMPUTE_OPS, Action, Op, Program, counterpart, format_grid
from plait.schedule.lower import check_sizes, resolve_stage_to_rank

__all__ = ["validate", "needs"]

_MAX_LISTED = 12  # problems listed in one error; the rest are counted
_BACKWARD_OPS = (Op.BACKWARD, Op.WEIGHT, Op.SEND_B, Op.RECV_B)


def needs(action: Action, stage_to_rank: dict[int, int], num_chunks: int) -> list[Action]:
    """The actions that must have run before `action` can run, on its rank or a peer's."""
    s, k = action.stage_index, action.microbatch_index
    op = action.op
    if op is Op.FORWARD:
        if s == 0:
            return []
        local = stage_to_rank[s - 1] == stage_to_rank[s]
        return [Action(s - 1, Op.FORWARD, k) if local else Action(s, Op.RECV_F, k)]
    if op is Op.BACKWARD:
        out = [Action(s, Op.FORWARD, k)]
        if s < num_chunks - 1:
            local = stage_to_rank[s + 1] == stage_to_rank[s]
            out.append(Action(s + 1, Op.BACKWARD, k) if local else Action(s, Op.RECV_B, k))
        return out
    if op is Op.WEIGHT:
        return [Action(s, Op.BACKWARD, k)]
    if op is Op.SEND_F:
        return [Action(s, Op.FORWARD, k)]
    if op is Op.SEND_B:
        return [Action(s, Op.BACKWARD, k)]
    if op is Op.RECV_F:
        return [Action(s - 1, Op.SEND_F, k)]
    return [Action(s + 1, Op.SEND_B, k)]  # RECV_B


def _at(rank: int, step: int, action: Action) -> str:
    """Where an action sits, for a message (built only when there is a problem to report)."""
    return f"rank {rank} step {step}: {action}"


def _raise_if(problems: list[str], headline: str) -> None:
    if not problems:
        return
    lines = [headline] + [f"  {p}" for p in problems[:_MAX_LISTED]]
    if len(problems) > _MAX_LISTED:
        lines.append(f"  ... and {len(problems) - _MAX_LISTED} more")
    raise ScheduleError("\n".join(lines))


def _check_placement(
    program: Program, ranks: dict[int, int], num_chunks: int, num_microbatches: int,
    forward_only: bool,
) -> None:
    """Every action names an existing stage and micro-batch and sits on its stage's rank."""
    problems: list[str] = []
    for rank, actions in sorted(program.items()):
        for step, a in enumerate(actions):
            s = a.stage_index
            if s >= num_chunks:
                problems.append(f"{_at(rank, step, a)} names stage {s}, but stages are 0..{num_chunks - 1}")
            elif a.microbatch_index >= num_microbatches:
                problems.append(
                    f"{_at(rank, step, a)} names micro-batch {a.microbatch_index}, but "
                    f"micro-batches are 0..{num_microbatches - 1}"
                )
            elif ranks[s] != rank:
                problems.append(f"{_at(rank, step, a)} belongs to stage {s} on rank {ranks[s]}; move it there")
            elif forward_only and a.op in _BACKWARD_OPS:
                problems.append(f"{_at(rank, step, a)} is a backward action in a forward-only program")
            elif a.op not in COMPUTE_OPS:
                peer = s + 1 if a.op in (Op.SEND_F, Op.RECV_B) else s - 1
                if not 0 <= peer < num_chunks:
                    problems.append(f"{_at(rank, step, a)} talks to stage {peer}, which does not exist")
                elif ranks[peer] == rank:
                    problems.append(
                        f"{_at(rank, step, a)} talks to stage {peer} on the same rank {rank}; "
                        f"the value is handed over in memory, drop {a} and {counterpart(a)}"
                    )
    _raise_if(problems, "actions in the wrong place:")


def _index(program: Program) -> dict[Action, tuple[int, int]]:
    """action -> (rank, step), after checking that no action occurs twice."""
    where: dict[Action, tuple[int, int]] = {}
    problems: list[str] = []
    for rank, actions in sorted(program.items()):
        for step, a in enumerate(actions):
            if a in where:
                first_rank, first_step = where[a]
                problems.append(
                    f"{a} occurs twice, at rank {first_rank} step {first_step} and rank {rank} "
                    f"step {step}; keep one"
                )
            else:
                where[a] = (rank, step)
    _raise_if(problems, "duplicated actions:")
    return where


def _check_complete(
    where: dict[Action, tuple[int, int]], ranks: dict[int, int], num_chunks: int,
    num_microbatches: int, forward_only: bool,
) -> None:
    """Every (stage, micro-batch) has its F, its B unless forward-only, and its W if any W exists.

    A program either splits every backward into B and W, or none.
    """
    ops: tuple[Op, ...] = (Op.FORWARD,)
    passes = "forward"
    if any(a.op is Op.WEIGHT for a in where):
        ops, passes = COMPUTE_OPS, "forward, input-gradient (B) and weight-gradient (W) backward"
    elif not forward_only:
        ops, passes = (Op.FORWARD, Op.BACKWARD), "forward and backward"
    missing = [
        f"{a} on rank {ranks[s]}"
        for s in range(num_chunks) for k in range(num_microbatches) for op in ops
        if (a := Action(s, op, k)) not in where
    ]
    _raise_if(
        missing,
        f"missing compute actions (each of the {num_chunks} stages runs each of the "
        f"{num_microbatches} micro-batches {passes} exactly once; generate the program with a "
        f"schedule generator):",
    )


def _check_order(
    program: Program, where: dict[Action, tuple[int, int]], ranks: dict[int, int],
    num_chunks: int,
) -> None:
    """Sends and receives pair up, every need exists, and local needs come earlier in the list."""
    problems: list[str] = []
    for rank, actions in sorted(program.items()):
        for step, a in enumerate(actions):
            if a.op not in COMPUTE_OPS:
                other = counterpart(a)
                if other not in where:
                    kind = "receive" if a.op in (Op.SEND_F, Op.SEND_B) else "send"
                    problems.append(
                        f"{_at(rank, step, a)} has no matching {kind} {other} on rank "
                        f"{ranks[other.stage_index]}; add it there (lower_communication does)"
                    )
                    continue
            for need in needs(a, ranks, num_chunks):
                need_rank = ranks[need.stage_index]
                if need not in where:
                    problems.append(
                        f"{_at(rank, step, a)} needs {need} on rank {need_rank}, which is "
                        f"missing; add it there (lower_communication inserts sends and receives)"
                    )
                elif need_rank == rank and where[need][1] > step:
                    problems.append(
                        f"{_at(rank, step, a)} comes before {need} (step {where[need][1]}), "
                        f"which it needs; move {a} after {need}"
                    )
    _raise_if(problems, "actions out of order or unmatched:")


def _simulate(
    program: Program, ranks: dict[int, int], num_chunks: int, num_microbatches: int
) -> None:
    """Run every rank's list in one process; raise with a grid if no rank can progress.

    A worklist: a blocked rank waits on the one action it lacks and is woken when that action
    runs, so each action is tried a bounded number of times (linear in the actions, where
    sweeping every rank until nothing moves is quadratic in the ranks of a long pipeline).
    Where every rank stops is the same either way: the fixpoint of the lists' rules.
    """
    done: set[Action] = set()
    positions = {rank: 0 for rank in program}
    waiting: dict[Action, list[int]] = {}  # a missing action -> the ranks blocked on it
    ready = list(program)
    while ready:
        rank = ready.pop()
        actions, i = program[rank], positions[rank]
        while i < len(actions):
            action = actions[i]
            missing = [n for n in needs(action, ranks, num_chunks) if n not in done]
            if missing:
                waiting.setdefault(missing[0], []).append(rank)
                break
            done.add(action)
            i += 1
            ready += waiting.pop(action, ())
        positions[rank] = i
    total = sum(len(actions) for actions in program.values())
    if len(done) == total:
        return
    lines = [
        f"deadlock: no rank can progress after {len(done)} of {total} actions "
        f"(num_chunks={num_chunks}, num_microbatches={num_microbatches})"
    ]
    for rank, actions in sorted(program.items()):
        if positions[rank] == len(actions):
            lines.append(f"  rank {rank} has finished")
            continue
        action = actions[positions[rank]]
        waits = []
        for need in needs(action, ranks, num_chunks):
            if need not in done:
                peer = ranks[need.stage_index]
                peer_step = positions[peer]
                waits.append(
                    f"{need} on rank {peer} (rank {peer} is blocked at step {peer_step} on "
                    f"{program[peer][peer_step]})"
                )
        lines.append(
            f"  rank {rank} is blocked at step {positions[rank]} on {action}, waiting for "
            + " and ".join(waits)
        )
    lines.append(
        "reorder the lists so that every receive can be matched by a send its peer reaches "
        "first (sends never block); the marked cells show where each rank stands:"
    )
    lines.append(format_grid(program, positions))
    raise ScheduleError("\n".join(lines))


def _check_send_order(program: Program, ranks: dict[int, int]) -> None:
    """For each rank pair src -> dst, dst receives src's messages in the order src sends them.

    Runs after `_check_order`, so every send has its receive and vice versa.
    """
    sends: dict[tuple[int, int], list[tuple[int, Action]]] = {}  # (src, dst) -> (step, send)
    receives: dict[tuple[int, int], list[tuple[int, Action]]] = {}  # (src, dst) -> (step, receive)
    for rank, actions in sorted(program.items()):
        for step, a in enumerate(actions):
            if a.op in (Op.SEND_F, Op.SEND_B):
                sends.setdefault((rank, ranks[counterpart(a).stage_index]), []).append((step, a))
            elif a.op in (Op.RECV_F, Op.RECV_B):
                receives.setdefault((ranks[counterpart(a).stage_index], rank), []).append((step, a))
    problems: list[str] = []
    for (src, dst), sent in sorted(sends.items()):
        taken = receives.get((src, dst), [])
        assert len(taken) == len(sent), f"unmatched messages {src} -> {dst} passed _check_order"
        for i, ((send_step, send), (recv_step, recv)) in enumerate(zip(sent, taken)):
            if counterpart(send) != recv:
                problems.append(
                    f"rank {src} -> rank {dst}, message {i}: rank {src} step {send_step} sends "
                    f"{send}, but rank {dst} step {recv_step} receives {recv} (expected "
                    f"{counterpart(send)}); move {counterpart(send)} ahead of {recv} on rank "
                    f"{dst}, or reorder rank {src}'s sends (lower_communication does the first)"
                )
                break  # the rest of this pair is shifted by the same swap
    _raise_if(
        problems,
        "messages taken out of send order (NCCL ignores tags and matches the messages between "
        "two ranks in the order they are posted; each rank must receive a peer's messages in "
        "the order the peer sends them):",
    )


def validate(
    program: Program,
    num_chunks: int,
    num_microbatches: int,
    stage_to_rank: dict[int, int] | None = None,
    *,
    forward_only: bool = False,
) -> None:
    """Raise ScheduleError unless `program` runs every F (and B, W) exactly once without deadlock.

    Checks, in order: actions name existing stages and micro-batches and sit on their stage's
    rank; no action occurs twice; every (stage, micro-batch) has one F and, unless
    `forward_only`, one B, and one W too if the program splits the backward; every send has
    its receive on the peer rank and vice versa; every action's inputs exist and the local
    ones come earlier (F before B before W); then the dry run; then that every rank receives
    each peer's messages in the order the peer sends them (NCCL matches by order, not tag).
    """
    check_sizes(num_chunks, num_microbatches)
    ranks = resolve_stage_to_rank(num_chunks, stage_to_rank)
    _check_placement(program, ranks, num_chunks, num_microbatches, forward_only)
    where = _index(program)
    _check_complete(where, ranks, num_chunks, num_microbatches, forward_only)
    _check_order(program, where, ranks, num_chunks)
    _simulate(program, ranks, num_chunks, num_microbatches)
    _check_send_order(program, ranks)
