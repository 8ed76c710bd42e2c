"""Closing the loop: measured stage times against the prediction, and costs corrected by them.

After the first steps of a run, the measured F + B + W time of one micro-batch on each stage
(medians from the trace) and the measured step time are compared with the `Prediction` the
layout was chosen by. `Feedback.summary()` is the log line; `should_replan` says whether the
error is large; `corrected_costs` scales each layer's times by its stage's measured/predicted
ratio, so searching again re-partitions with what this machine really does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from plait.cost.prediction import Prediction
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts

__all__ = ["StageCheck", "Feedback", "compare", "should_replan", "corrected_costs"]


@dataclass(frozen=True)
class StageCheck:
    """One stage's predicted and measured time of one micro-batch (F + B + W)."""

    stage_index: int
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted; 0 when both are 0."""
        if self.predicted_s <= 0:
            return 0.0 if self.measured_s <= 0 else float("inf")
        return (self.measured_s - self.predicted_s) / self.predicted_s


@dataclass(frozen=True)
class Feedback:
    """Per-stage and whole-step comparison of a run with its prediction."""

    stages: tuple[StageCheck, ...]
    predicted_step_s: float
    measured_step_s: float

    @property
    def step_error(self) -> float:
        return StageCheck(-1, self.predicted_step_s, self.measured_step_s).error

    @property
    def worst_stage_error(self) -> float:
        return max((abs(s.error) for s in self.stages), default=0.0)

    def summary(self) -> str:
        """One log line: the step, then each stage, predicted vs measured."""
        parts = ", ".join(
            f"{s.stage_index}: {1e3 * s.predicted_s:.1f}/{1e3 * s.measured_s:.1f} ms ({s.error:+.0%})"
            for s in self.stages
        )
        return (f"plait plan check: step predicted {self.predicted_step_s:.4f} s, measured "
                f"{self.measured_step_s:.4f} s ({self.step_error:+.0%}); per stage predicted/measured "
                f"F+B+W of a micro-batch: {parts}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_step_time_s": self.predicted_step_s, "measured_step_time_s": self.measured_step_s,
            "step_error": self.step_error,
            "stages": [{"stage": s.stage_index, "predicted_s": s.predicted_s, "measured_s": s.measured_s,
                        "error": s.error} for s in self.stages],
        }


def _stage_time(prediction: Prediction, stage_index: int) -> float:
    s = prediction.stages[stage_index]
    return s.forward_s + s.backward_s + s.weight_s


def compare(prediction: Prediction, measured_stage_s: Sequence[float], measured_step_s: float) -> Feedback:
    """Feedback of a run: `measured_stage_s[s]` is stage s's F + B + W of one micro-batch."""
    if len(measured_stage_s) != len(prediction.stages):
        raise ConfigError(
            f"{len(measured_stage_s)} measured stage times for a layout of "
            f"{len(prediction.stages)} stages; give one per stage, in stage order"
        )
    checks = tuple(StageCheck(i, _stage_time(prediction, i), float(t))
                   for i, t in enumerate(measured_stage_s))
    return Feedback(checks, prediction.step_time_s, float(measured_step_s))


def should_replan(feedback: Feedback, threshold: float = 0.15) -> bool:
    """True when a stage or the whole step is off by more than `threshold` (relative)."""
    return feedback.worst_stage_error > threshold or abs(feedback.step_error) > threshold


def corrected_costs(costs: LayerCosts, prediction: Prediction, measured_stage_s: Sequence[float]) -> LayerCosts:
    """`costs` with every layer's times scaled by its stage's measured / predicted ratio
    (a stage predicted to take no time keeps its layers' times)."""
    feedback = compare(prediction, measured_stage_s, prediction.step_time_s)
    scale = [1.0] * costs.num_layers
    for check, stage in zip(feedback.stages, prediction.stages):
        if check.predicted_s > 0:
            for layer in range(stage.start, stage.end):
                scale[layer] = check.measured_s / check.predicted_s
    data = costs.to_dict()
    for name in ("forward_fixed_s", "forward_row_s", "backward_fixed_s", "backward_row_s",
                 "weight_fixed_s", "weight_row_s"):
        data[name] = [t * k for t, k in zip(data[name], scale)]
    data["source"] = costs.source + " (corrected by measured stage times)"
    return LayerCosts.from_dict(data)
