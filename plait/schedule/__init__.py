"""Pipeline schedules as data: per-rank action lists, their lowering, and a deadlock dry run."""

from __future__ import annotations

from plait.schedule.action import Action, Op, Program, format_grid, format_program, parse_action
from plait.schedule.generators import SCHEDULES, forward_only, generate, gpipe, one_f_one_b
from plait.schedule.lower import lower_communication
from plait.schedule.validate import validate

__all__ = [
    "Op",
    "Action",
    "Program",
    "parse_action",
    "format_program",
    "format_grid",
    "gpipe",
    "one_f_one_b",
    "forward_only",
    "generate",
    "SCHEDULES",
    "lower_communication",
    "validate",
]
