"""plait: automatic pipeline-parallel training of an unmodified PyTorch model."""

from plait.config import Config
from plait.errors import (
    CaptureError,
    CheckpointError,
    ConfigError,
    LossError,
    ModelError,
    NonFiniteError,
    PartitionError,
    PipelineError,
    PlaitError,
    ScheduleError,
)
from plait.job.process_group import init_process_group
from plait.materialize import materialize
from plait.model import Model
from plait.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Config",
    "Plan",
    "init_process_group",
    "materialize",
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
