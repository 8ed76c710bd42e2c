"""Where a tracer stopped: the innermost module of the model whose code was running, and the line.

A tracer's error (torch.export's data-dependent guard, torch.fx's proxy in control flow) is
raised deep inside torch; the frames between hold the user's code. The innermost frame whose
`self` is a submodule of the model names the module to keep whole (`Config(leaf_modules=...)`,
or plait itself on retrying) and the line that could not be traced, for the error message.
"""

from __future__ import annotations

import linecache
import traceback
from dataclasses import dataclass

from torch import nn

__all__ = ["Stop", "stopped_in"]


@dataclass(frozen=True)
class Stop:
    """A tracer's stop: the module (qualified name, "" for the model itself), its class, the code line."""

    module: str
    kind: str
    where: str  # "file.py:123: the line"

    def describe(self) -> str:
        name = f"module {self.module!r} ({self.kind})" if self.module else f"the model's own forward ({self.kind})"
        return f"{name}, at {self.where}"


def stopped_in(error: BaseException, net: nn.Module) -> Stop | None:
    """The innermost submodule of `net` running when `error` was raised (through its causes)."""
    names = {id(m): n for n, m in net.named_modules(remove_duplicate=False)}
    found: Stop | None = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame, lineno in traceback.walk_tb(current.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                line = linecache.getline(frame.f_code.co_filename, lineno).strip()
                found = Stop(names[id(owner)], type(owner).__name__,
                             f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{lineno}: {line}")
        current = current.__cause__ or current.__context__
    return found
