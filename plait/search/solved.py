"""Solved partitions, shared by settings whose problems differ only in memory.

GPipe and 1F1B share one closed form (and, with batched weight gradients, everything), and the
ZeRO levels change only the state bytes; at 7,500 layers each partition is seconds of work. A
problem's optimum under a looser memory bound (every layout that fits the tighter problem fits
it, the same objective terms) is the tighter problem's optimum too whenever it fits there: its
objective is the least over a superset. So the search solves a setting's loosest sibling
(`SolvedPartitions.solve`'s `loosest`) and solves the setting itself only where that layout does
not fit. The layout reused is optimal with the same T to the last bit; among layouts of equal T
it may be another than a direct solve would pick.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from plait.cost.problem import PartitionProblem
from plait.search.partition import Infeasible, PartitionResult, solve_partition

__all__ = ["SolvedPartitions", "looser"]

Found = PartitionResult | Infeasible
_MEMORY = ("fixed", "per_held", "once", "entry")


def _objective(problem: PartitionProblem) -> tuple[Any, ...]:
    """What T depends on: two problems alike here differ only in memory."""
    return (tuple(problem.time), tuple(problem.fill), tuple(problem.last_fill), tuple(problem.cut_time),
            problem.bottleneck_count, problem.num_chunks, tuple(map(tuple, problem.uncuttable)))


def _memory(problem: PartitionProblem) -> tuple[Any, ...]:
    return (tuple(problem.held), problem.memory_limit, *(tuple(getattr(problem, name))
                                                         for name in (*_MEMORY, "piece_once", "piece_entry")))


def _values(problem: PartitionProblem, name: str) -> np.ndarray:
    values = getattr(problem, name)
    return np.asarray(values, dtype=np.float64) if len(values) else np.zeros(len(problem.time))


def looser(wide: PartitionProblem, narrow: PartitionProblem) -> bool:
    """Whether every layout that fits `narrow` fits `wide` (a sufficient check): the same
    objective, a memory limit as large, and every memory term as small, term by term and
    nonnegative (each stage's memory grows with each of them). Recomputing piece by piece is
    a lesser of two forms: only where `narrow` has it must `wide` have it too."""
    return _objective(wide) == _objective(narrow) and _fits_within(wide, narrow)


def _fits_within(wide: PartitionProblem, narrow: PartitionProblem) -> bool:
    """`looser`'s memory half, for problems already known to share their objective."""
    if wide.memory_limit < narrow.memory_limit:
        return False
    if len(narrow.piece_once) and not len(wide.piece_once):
        return False
    names = _MEMORY + (("piece_once", "piece_entry") if len(wide.piece_once) and len(narrow.piece_once) else ())
    pairs = [(np.asarray(wide.held, dtype=np.float64), np.asarray(narrow.held, dtype=np.float64))]
    pairs += [(_values(wide, name), _values(narrow, name)) for name in names]
    return all(bool(np.all(w >= 0) and np.all(w <= n)) for w, n in pairs)


class SolvedPartitions:
    """`solve_partition` once per problem, and once per family of problems where the loosest
    one's layout fits the others."""

    def __init__(self) -> None:
        # per objective: each problem solved or matched, its memory key, and its layout
        self._found: dict[tuple[Any, ...], list[tuple[PartitionProblem, tuple[Any, ...], Found]]] = {}

    def solve(self, problem: PartitionProblem,
              loosest: Callable[[], PartitionProblem] | None = None) -> Found:
        """`solve_partition(problem)`, or the layout of a looser problem solved before (or of
        `loosest()`, built and solved only when neither is found) where it fits `problem`."""
        known = self._found.setdefault(_objective(problem), [])
        mine = _memory(problem)
        for _, memory, found in known:
            if memory == mine:
                return found
        for other, _, found in known:
            if self._reusable(other, found, problem):
                known.append((problem, mine, found))
                return found
        wide = loosest() if loosest is not None else None
        if wide is not None and _memory(wide) != mine and looser(wide, problem):
            found = self.solve(wide)
            if _fits(found, problem):  # `looser` has compared the memory terms
                known.append((problem, mine, found))
                return found
        found = solve_partition(problem)
        known.append((problem, mine, found))
        return found

    @staticmethod
    def _reusable(other: PartitionProblem, found: Found, problem: PartitionProblem) -> bool:
        """`other`'s layout for `problem`, which shares its objective: looser and fitting."""
        return _fits_within(other, problem) and _fits(found, problem)


def _fits(found: Found, problem: PartitionProblem) -> bool:
    """Whether `found` is a layout and fits `problem`'s memory (a finite objective)."""
    return isinstance(found, PartitionResult) and math.isfinite(problem.objective(found.layers_per_stage))
