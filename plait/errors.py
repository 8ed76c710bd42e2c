"""The exceptions plait raises; every message names the offending values and the fix."""

from __future__ import annotations

import sys
import sysconfig
import traceback
from pathlib import Path

__all__ = [
    "PlaitError",
    "ConfigError",
    "CaptureError",
    "PartitionError",
    "ScheduleError",
    "LossError",
    "PipelineError",
    "CheckpointError",
    "NonFiniteError",
    "ModelError",
]


class PlaitError(Exception):
    """Base class of every error plait raises."""


class ConfigError(PlaitError, ValueError):
    """A `Config` value, or the world size it is run with, does not fit."""


class CaptureError(PlaitError):
    """The model could not be captured into a layer graph."""


class PartitionError(PlaitError, ValueError):
    """A requested split of the layers into stages is impossible."""


class ScheduleError(PlaitError):
    """A pipeline schedule is malformed or would deadlock."""


class LossError(PlaitError, ValueError):
    """The loss function did not return a scalar tensor."""


class PipelineError(PlaitError, RuntimeError):
    """A rank failed while running its pipeline program (names rank, action and peer)."""


class CheckpointError(PlaitError):
    """A checkpoint is missing, incomplete, damaged, or does not fit the model (names what and why)."""


class NonFiniteError(PlaitError, FloatingPointError):
    """A training step produced a NaN or infinite value (names the step and the stage)."""


class ModelError(PlaitError, RuntimeError):
    """The model's own code (its forward, the loss) raised on a rank: names the rank, where, and the line."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message ("" where it has none), for one-line reports."""
    text = str(error)
    return text.splitlines()[0] if text else ""


def _theirs(path: str) -> bool:
    """A file of plait, torch (its fx and export run the user's modules) or the standard library;
    "<eval_with_key>.3" and other generated code too."""
    if path.startswith("<"):
        return True
    path = str(Path(path).resolve())
    torch_module = sys.modules.get("torch")
    trees = [Path(__file__).resolve().parent] + ([Path(torch_module.__file__).resolve().parent]
                                                 if torch_module is not None and torch_module.__file__ else [])
    stdlib = str(Path(sysconfig.get_paths()["stdlib"]).resolve())
    return any(path.startswith(str(tree)) for tree in trees) or (path.startswith(stdlib) and "site-packages" not in path)


def model_frame(error: BaseException) -> str | None:
    """Where the model's own code raised `error` ('File "net.py", line 12, in forward: raise ...'):
    the innermost frame of its traceback outside plait, torch and the standard library; None if none."""
    found = [f for f in traceback.extract_tb(error.__traceback__) if not _theirs(f.filename)]
    if not found:
        return None
    f = found[-1]
    return f'File "{f.filename}", line {f.lineno}, in {f.name}: {(f.line or "").strip()}'
