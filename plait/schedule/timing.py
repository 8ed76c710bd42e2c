"""The one timing model of compute-only programs: start and end of every F, B and W action."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

from plait.errors import ScheduleError
from plait.schedule.action import COMPUTE_OPS, Action, Op, Program

__all__ = ["compute_needs", "time_actions", "clock_cycles", "format_timeline"]


def compute_needs(action: Action, num_chunks: int) -> list[Action]:
    """The compute actions whose results `action` (an F, B or W) consumes.

    F(s, k) reads the output of F(s-1, k); B(s, k) reads its own F(s, k) (saved activations)
    and the gradient produced by B(s+1, k); W(s, k) reads what B(s, k) left behind (the
    gradient of the stage's output), so it runs after B(s, k) on the same rank.
    """
    s, k = action.stage_index, action.microbatch_index
    if action.op is Op.FORWARD:
        return [Action(s - 1, Op.FORWARD, k)] if s > 0 else []
    if action.op is Op.WEIGHT:
        return [Action(s, Op.BACKWARD, k)]
    needs = [Action(s, Op.FORWARD, k)]
    if s < num_chunks - 1:
        needs.append(Action(s + 1, Op.BACKWARD, k))
    return needs


def time_actions(
    program: Program,
    num_chunks: int,
    duration: Callable[[Action], Fraction],
    transfer: Fraction = Fraction(0),
) -> dict[Action, tuple[Fraction, Fraction]]:
    """(start, end) of each action of a compute-only program: an event simulation.

    Each rank runs its list in order, one action at a time, and starts an action as soon as the
    rank is free and every action it needs has finished, plus `transfer` when that action ran
    on another rank (the hand-over of an activation or a gradient). Times are exact fractions.
    Both `clock_cycles` and `plait.schedule.simulate` are this function with their own costs.
    """
    for rank, actions in program.items():
        for action in actions:
            if action.op not in COMPUTE_OPS:
                raise ScheduleError(
                    f"timing takes a compute-only program (F, B and W), but rank {rank} holds "
                    f"{action}; time the program before lower_communication"
                )
    times: dict[Action, tuple[Fraction, Fraction]] = {}
    rank_of: dict[Action, int] = {}
    positions = {rank: 0 for rank in program}
    free_at = {rank: Fraction(0) for rank in program}
    # A worklist, linear in the actions: a blocked rank waits on the one action it lacks and
    # is woken when that action is timed. An action's times depend only on its needs and its
    # rank's previous action, so the order in which ranks advance changes nothing.
    waiting: dict[Action, list[int]] = {}
    ready = list(program)
    while ready:
        rank = ready.pop()
        actions = program[rank]
        while positions[rank] < len(actions):
            action = actions[positions[rank]]
            needs = compute_needs(action, num_chunks)
            missing = [need for need in needs if need not in times]
            if missing:
                waiting.setdefault(missing[0], []).append(rank)
                break
            begin = max([free_at[rank]] + [
                times[need][1] + (transfer if rank_of[need] != rank else 0) for need in needs
            ])
            times[action] = (begin, begin + duration(action))
            rank_of[action] = rank
            free_at[rank] = times[action][1]
            positions[rank] += 1
            ready += waiting.pop(action, ())
    stuck = {r: str(a[positions[r]]) for r, a in program.items() if positions[r] < len(a)}
    if stuck:
        raise ScheduleError(
            f"cannot time the program: ranks wait forever at {stuck}; run validate() on it "
            f"to see which action each one waits for"
        )
    return times


def clock_cycles(program: Program, num_chunks: int) -> dict[Action, int]:
    """The clock cycle at which each action starts when every F, B and W takes one cycle.

    `time_actions` with unit costs and free communication. With one stage per rank GPipe and
    1F1B both finish in 2(m + p - 1) cycles, of which 2(p - 1) are bubble on every stage: the
    (p-1)/(m+p-1) bubble fraction of GPipe (Huang et al. 2019) and PipeDream-Flush (Narayanan
    et al. 2021).
    """
    times = time_actions(program, num_chunks, lambda action: Fraction(1))
    return {action: int(start) for action, (start, _) in times.items()}


def format_timeline(program: Program, num_chunks: int) -> str:
    """Draw a compute-only program against the clock, one row per rank (torchgpipe style).

    For `one_f_one_b(2, 2)`:

        clock  |  0    1    2    3    4    5
        rank 0 | 0F0  0F1       0B0       0B1
        rank 1 |      1F0  1B0  1F1  1B1
    """
    start = clock_cycles(program, num_chunks)
    num_cycles = max(start.values(), default=-1) + 1
    width = max([len(str(a)) for a in start] + [len(str(num_cycles - 1))]) + 2
    label_width = max([len(f"rank {r}") for r in program] + [len("clock")])
    lines = [f"{'clock'.ljust(label_width)} |" + "".join(
        str(c).center(width) for c in range(num_cycles)
    )]
    for rank in sorted(program):
        cells = [""] * num_cycles
        for action in program[rank]:
            cells[start[action]] = str(action)
        lines.append(f"{f'rank {rank}'.ljust(label_width)} |" + "".join(
            c.center(width) for c in cells
        ))
    return "\n".join(line.rstrip() for line in lines)
