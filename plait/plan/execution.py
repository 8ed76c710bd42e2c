"""`Execution`: how the runtime runs a plan where that is not layout (waits, traces, sums, non-finite steps)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError

__all__ = ["Execution", "NONFINITE_ACTIONS", "GRAD_REDUCTIONS"]

NONFINITE_ACTIONS = ("stop", "skip", "ignore")  # what a NaN or infinite loss or stage output does
GRAD_REDUCTIONS = ("mean", "sum")  # the gradient of the global batch's mean loss, or of the sum of its means


@dataclass(frozen=True)
class Execution:
    """The runtime's settings beside the `Plan` (made by `Config.execution()`; the runtime reads
    these and the plan, never the user's Config).

    timeout_s: longest wait on another rank before the run fails with a report.
    trace_dir: where each rank writes its measured timeline (None: no trace).
    on_nonfinite: "stop", "skip" or "ignore" a step with a non-finite loss or output.
    grad_reduction: "mean" (what one process computes) or "sum" of the replicas' means.
    bucket_bytes: bytes of one gradient bucket summed over replicas.
    memory_limit_bytes: the tensor-parallel search's budget for a rank's parameter state (None: the device's).
    clip_grad_norm: the largest global gradient norm; above it every gradient is scaled down to it (None: no clipping).
    accumulate_steps: global batches whose gradients are summed (each loss / accumulate_steps) before one optimizer step.
    reduce_precision: the dtype the data-parallel gradient sums run in ("fp32", or "bf16" on request).
    compile_backend: the torch.compile backend each stage's graph runs through (None: eager).
    """

    timeout_s: float = 300.0
    trace_dir: str | None = None
    on_nonfinite: str = "stop"
    grad_reduction: str = "mean"
    bucket_bytes: int = 25 * 2**20
    memory_limit_bytes: float | None = None
    clip_grad_norm: float | None = None
    accumulate_steps: int = 1
    reduce_precision: str = "fp32"
    compile_backend: str | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"Execution has timeout_s={self.timeout_s!r}; it must be a positive number of seconds")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ConfigError(f"Execution has on_nonfinite={self.on_nonfinite!r}; choose one of {list(NONFINITE_ACTIONS)}")
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ConfigError(f"Execution has grad_reduction={self.grad_reduction!r}; choose one of "
                              f"{list(GRAD_REDUCTIONS)}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"Execution has clip_grad_norm={self.clip_grad_norm!r}; it must be a positive number or None")
        if not (isinstance(self.accumulate_steps, int) and self.accumulate_steps >= 1):
            raise ConfigError(f"Execution has accumulate_steps={self.accumulate_steps!r}; it must be a positive integer")
        if self.reduce_precision not in ("fp32", "bf16"):
            raise ConfigError(f"Execution has reduce_precision={self.reduce_precision!r}; choose 'fp32' or 'bf16'")
        if not (isinstance(self.bucket_bytes, int) and self.bucket_bytes > 0):
            raise ConfigError(f"Execution has bucket_bytes={self.bucket_bytes!r}; it must be a positive integer")
