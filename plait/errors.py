"""The exceptions plait raises; every message names the offending values and the fix."""

from __future__ import annotations

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
