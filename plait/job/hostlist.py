"""Slurm's compact lists expanded: host lists ("gpu[01-03,07]") and tasks per node ("2(x3),1")."""

from __future__ import annotations

import itertools
import re

from plait.errors import ConfigError

__all__ = ["expand_nodelist", "expand_tasks_per_node"]

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ConfigError(f"Slurm node list {text!r} has nested or unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"Slurm node list {text!r} has an unclosed '['")
    return parts + [text[start:]]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    """"01-03,7" -> ["01", "02", "03", "7"]; the width of the first bound is kept (zero padding)."""
    out = []
    for item in spec.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ConfigError(f"Slurm node list {nodelist!r}: {item!r} is not a number or a range a-b")
        if not sep:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ConfigError(f"Slurm node list {nodelist!r}: range {item!r} runs backwards")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's host list syntax, expanded in order.

    >>> expand_nodelist("gpu[01-03,07],login1")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']
    >>> expand_nodelist("rack[1-2]-n[0-1]")
    ['rack1-n0', 'rack1-n1', 'rack2-n0', 'rack2-n1']
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        if not part:
            raise ConfigError(f"Slurm node list {nodelist!r} has an empty entry")
        pieces = _BRACKET.split(part)  # text, range, text, range, ..., text
        if "[" in "".join(pieces[::2]) or "]" in "".join(pieces[::2]):
            raise ConfigError(f"Slurm node list {nodelist!r} has unbalanced brackets")
        choices = [[p] if i % 2 == 0 else _expand_range(p, nodelist) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's SLURM_TASKS_PER_NODE form: "2(x3),1" -> [2, 2, 2, 1]."""
    out = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ConfigError(f"tasks per node {spec!r}: {item!r} is not N or N(xM)")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    return out
