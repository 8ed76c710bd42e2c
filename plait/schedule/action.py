"""Pipeline actions, their short text form (`2F0`), and printing of per-rank programs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from plait.errors import ScheduleError

__all__ = [
    "Op", "Action", "Program", "COMPUTE_OPS", "counterpart", "parse_action", "format_program", "format_grid",
]


class Op(str, Enum):
    """What a rank does in one step; the value is the text between the two numbers of `2F0`.

    Direction words follow the activations: `SEND_F` ships stage s's output of micro-batch k to
    stage s+1 (`RECV_F` of stage s+1 takes it); `SEND_B` ships the gradient of stage s's input to
    stage s-1 (`RECV_B` of stage s-1 takes it).

    Zero-bubble schedules split the backward (Qi et al. 2023): there `BACKWARD` computes only the
    gradient of the stage's input (what `SEND_B` ships upstream at once) and `WEIGHT` computes
    the gradients of the stage's parameters for the same micro-batch, later, on the same rank.
    In a program without `WEIGHT` actions, `BACKWARD` is the whole backward.
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    def __str__(self) -> str:
        return self.value


# Two-letter ops first, so that "SF" is never read as stage digits followed by "F".
_ACTION_RE = re.compile(r"(\d+)(SF|RF|SB|RB|F|B|W)(\d+)")


@dataclass(frozen=True)
class Action:
    """Stage `stage_index` does `op` on micro-batch `microbatch_index`; `str()` gives `2F0`."""

    stage_index: int
    op: Op
    microbatch_index: int

    def __post_init__(self) -> None:
        s, k = self.stage_index, self.microbatch_index
        if type(s) is int and type(k) is int and s >= 0 and k >= 0 and type(self.op) is Op:
            return  # the common case, checked cheaply: programs hold millions of actions
        for name in ("stage_index", "microbatch_index"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(
                    f"Action {name} must be an int >= 0, got {value!r}; "
                    f"count stages and micro-batches from 0"
                )
        if not isinstance(self.op, Op):
            try:
                object.__setattr__(self, "op", Op(self.op))
            except ValueError:
                known = ", ".join(op.value for op in Op)
                raise ScheduleError(
                    f"Action op must be one of {known}, got {self.op!r}"
                ) from None

    def __str__(self) -> str:
        return f"{self.stage_index}{self.op.value}{self.microbatch_index}"


Program: TypeAlias = dict[int, list[Action]]
"""rank -> the actions that rank executes, in order."""

COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
"""The ops that compute; the others move a value between ranks."""


def parse_action(text: str) -> Action:
    """Read the text form back into an Action: `"2F0"` -> `Action(2, Op.FORWARD, 0)`."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        known = "|".join(op.value for op in Op)
        raise ScheduleError(
            f"cannot parse action {text!r}; expected <stage><op><microbatch> with op in "
            f"{known}, e.g. '2F0' or '1SF3'"
        )
    stage, op, microbatch = match.groups()
    return Action(int(stage), Op(op), int(microbatch))


def format_program(program: Program) -> str:
    """One line per rank, ranks ascending: `rank 0: 0F0 0SF0 0F1 ...`."""
    return "\n".join(
        f"rank {rank}: {' '.join(str(a) for a in program[rank])}".rstrip()
        for rank in sorted(program)
    )


def format_grid(program: Program, positions: dict[int, int] | None = None) -> str:
    """A rank x step table of the program; `positions[rank]` marks where that rank stands.

    The marked cell is wrapped in brackets; a rank whose position is past its last action is
    shown as `(done)`. Example, rank 0 stuck at step 2 and rank 1 finished:

        step   | 0      1      2      3
        rank 0 | 0F0    0SF0  [0RB0]  0B0
        rank 1 | 1RF0   1F0    1B0    1SB0   (done)
    """
    ranks = sorted(program)
    num_steps = max((len(program[r]) for r in ranks), default=0)
    texts = {r: [str(a) for a in program[r]] for r in ranks}
    width = max([len(t) for r in ranks for t in texts[r]] + [len(str(num_steps - 1))]) + 3
    label_width = max([len(f"rank {r}") for r in ranks] + [len("step")])

    def cell(text: str, marked: bool) -> str:
        return (f"[{text}]" if marked else f" {text} ").ljust(width)

    header = [f"{'step'.ljust(label_width)} |"] + [cell(str(i), False) for i in range(num_steps)]
    lines = ["".join(header).rstrip()]
    for rank in ranks:
        position = None if positions is None else positions.get(rank)
        row = [f"{f'rank {rank}'.ljust(label_width)} |"]
        row += [cell(t, i == position) for i, t in enumerate(texts[rank])]
        if position is not None and position >= len(texts[rank]):
            row.append(" (done)")
        lines.append("".join(row).rstrip())
    return "\n".join(lines)


def counterpart(action: Action) -> Action:
    """The other end of a send or receive: SF(s, k) <-> RF(s+1, k), SB(s, k) <-> RB(s-1, k)."""
    s, k = action.stage_index, action.microbatch_index
    if action.op is Op.SEND_F:
        return Action(s + 1, Op.RECV_F, k)
    if action.op is Op.RECV_F:
        return Action(s - 1, Op.SEND_F, k)
    if action.op is Op.SEND_B:
        return Action(s - 1, Op.RECV_B, k)
    assert action.op is Op.RECV_B, f"{action} is not a send or receive"
    return Action(s + 1, Op.SEND_B, k)
