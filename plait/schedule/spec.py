"""`ScheduleSpec`: everything plait asks of a schedule, given once where the schedule is registered.

A schedule is its generator (the per-rank action lists) and a few facts the planner and cost
model read instead of comparing names: whether it takes several chunks per rank, whether it
splits the backward into B and W, how many micro-batches each rank holds at its peak (a closed
form of what the program does, checked against it at registration), which closed form times
its step, and how the searches treat it. `plait.schedule.registry` keeps the one list.

Peaks, per pipeline position s of p, m micro-batches (a chunk counts 1/v):

    GPipe (Huang et al. 2019)        m on every position
    1F1B (Narayanan et al. 2021)     min(p - s, m)
    ZB-H1 (Qi et al. 2023)           min(p, m) (F done, W not yet); with recomputation W runs
                                     inside B and it holds as 1F1B
    interleaved (Megatron)           `interleaved_peaks`
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from plait.errors import ScheduleError
from plait.schedule.action import Program
from plait.schedule.generators import gpipe, one_f_one_b, zbh1
from plait.schedule.interleaved import group_sizes, interleaved

__all__ = ["ClosedForm", "ScheduleSpec", "Peaks", "BUILTIN", "interleaved_peaks"]

# (num_ranks p, num_microbatches m, num_virtual_stages v, recompute) -> peak per position
Peaks = Callable[[int, int, int, bool], tuple[float, ...]]


class ClosedForm(enum.Enum):
    """Which closed form times the step for the partition (`plait.cost.layer_times`)."""

    PLAIN = "plain"  # (m + p - 1) t, t = F + B + W (Alpa eq. 2): GPipe, 1F1B
    INTERLEAVED = "megatron"  # Megatron's (m + (p - 1)/v) t once m >= p; needs virtual
    ZERO_BUBBLE = "zero-bubble"  # m (F + B + W) + (p - 1)(F + B - W) once m >= p; needs splits_backward


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its generator and what the rest of plait asks of it.

    `generator(num_stages, num_microbatches)` returns the compute-only program (F, B and W of
    each stage, stage s on rank s); a `virtual` one is called as `generator(num_chunks,
    num_microbatches, num_virtual_stages, forward_only=...)` and places stage s on rank s % p.
    `peak_activations(p, m, v, recompute)`: micro-batches each position holds at once.
    """

    name: str
    generator: Callable[..., Program]
    peak_activations: Peaks
    virtual: bool = False  # takes num_virtual_stages (several model chunks per rank)
    splits_backward: bool = False  # B (input gradient) and W (weight gradient) are separate actions
    closed_form: ClosedForm = ClosedForm.PLAIN
    holds_all_microbatches: bool = False  # every position holds all m (GPipe's memory)
    mixed_widths: bool = False  # stages of different widths may run it: it holds as 1F1B or GPipe
    search_order: int = 100  # the planner's order: equal predictions go to the lower
    leaner: str | None = None  # the same closed form holding fewer micro-batches: its partition is shared
    one_chunk_as: str | None = None  # a virtual schedule with one chunk per rank is planned as this one

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise ScheduleError(f"a schedule's name must be a non-empty string, got {self.name!r}")
        if not callable(self.generator) or not callable(self.peak_activations):
            raise ScheduleError(f"schedule {self.name!r}: generator and peak_activations must be callable")
        if self.closed_form is ClosedForm.INTERLEAVED and not self.virtual:
            raise ScheduleError(f"schedule {self.name!r}: the interleaved closed form needs virtual=True")
        if self.closed_form is ClosedForm.ZERO_BUBBLE and not self.splits_backward:
            raise ScheduleError(f"schedule {self.name!r}: the zero-bubble closed form needs splits_backward=True")
        if self.one_chunk_as is not None and not self.virtual:
            raise ScheduleError(f"schedule {self.name!r}: one_chunk_as is for virtual schedules only")
        if self.mixed_widths and self.virtual:
            raise ScheduleError(f"schedule {self.name!r}: stages of different widths run one chunk per rank")


def _all(p: int, m: int, v: int, recompute: bool) -> tuple[float, ...]:
    return (float(m),) * p


def _one_f_one_b(p: int, m: int, v: int, recompute: bool) -> tuple[float, ...]:
    return tuple(float(min(p - s, m)) for s in range(p))


def _zbh1(p: int, m: int, v: int, recompute: bool) -> tuple[float, ...]:
    return _one_f_one_b(p, m, v, recompute) if recompute else (float(min(p, m)),) * p


def interleaved_peaks(p: int, m: int, v: int, recompute: bool) -> tuple[float, ...]:
    """Rank r runs w = 2(p - r - 1) + (v - 1)G warmup forwards (G the largest micro-batch
    group; all m v when m = p) and then holds one more chunk before its first backward."""
    chunks, largest = m * v, max(group_sizes(m, p))
    peaks = []
    for r in range(p):
        warmup = chunks if m == p else min(2 * (p - r - 1) + (v - 1) * largest, chunks)
        peaks.append((warmup + 1 if warmup < chunks else chunks) / v)
    return tuple(peaks)


BUILTIN = (  # registered in this order: Config's list of names
    ScheduleSpec("gpipe", gpipe, _all, holds_all_microbatches=True, mixed_widths=True, search_order=1,
                 leaner="1f1b"),
    ScheduleSpec("1f1b", one_f_one_b, _one_f_one_b, mixed_widths=True, search_order=0),
    ScheduleSpec("interleaved", interleaved, interleaved_peaks, virtual=True, closed_form=ClosedForm.INTERLEAVED,
                 search_order=3, one_chunk_as="1f1b"),
    ScheduleSpec("zbh1", zbh1, _zbh1, splits_backward=True, closed_form=ClosedForm.ZERO_BUBBLE, search_order=2),
)
