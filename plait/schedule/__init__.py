"""Pipeline schedules as data: per-rank action lists, their lowering, a deadlock dry run, timing."""

from __future__ import annotations

from plait.schedule.action import Action, Op, Program, format_grid, format_program, parse_action
from plait.schedule.generators import forward_only, gpipe, one_f_one_b, zbh1
from plait.schedule.interleaved import interleaved
from plait.schedule.lower import lower_communication
from plait.schedule.registry import SCHEDULES, generate, splits_backward
from plait.schedule.simulate import Event, Simulation, simulate
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
    "zbh1",
    "interleaved",
    "forward_only",
    "generate",
    "splits_backward",
    "SCHEDULES",
    "lower_communication",
    "validate",
    "simulate",
    "Simulation",
    "Event",
]
