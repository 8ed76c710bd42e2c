"""The `Plan`: how the model is laid out on the ranks, as printable JSON-ready data."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from plait.errors import ConfigError

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """Layers per stage, schedule and rank layout of one run."""

    layer_names: tuple[str, ...]
    layers_per_stage: tuple[int, ...]
    num_microbatches: int
    schedule: str
    world_size: int
    capture_method: str
    uncuttable: tuple[tuple[int, int], ...] = ()
    tied_parameters: tuple[tuple[str, tuple[int, ...]], ...] = ()  # name -> stages holding it
    stage_to_rank: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if sum(self.layers_per_stage) != len(self.layer_names):
            raise ConfigError(
                f"plan has layers_per_stage={list(self.layers_per_stage)} for "
                f"{len(self.layer_names)} layers"
            )
        if not self.stage_to_rank:
            object.__setattr__(self, "stage_to_rank", tuple(range(self.num_stages)))

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    def stage_layers(self, stage_index: int) -> tuple[str, ...]:
        """Names of the layers on one stage."""
        start = sum(self.layers_per_stage[:stage_index])
        return self.layer_names[start : start + self.layers_per_stage[stage_index]]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data: dict[str, Any] = json.loads(text)
            return cls(
                layer_names=tuple(data["layer_names"]),
                layers_per_stage=tuple(data["layers_per_stage"]),
                num_microbatches=int(data["num_microbatches"]),
                schedule=str(data["schedule"]),
                world_size=int(data["world_size"]),
                capture_method=str(data["capture_method"]),
                uncuttable=tuple((int(r[0]), int(r[1])) for r in data.get("uncuttable", ())),
                tied_parameters=tuple(
                    (str(n), tuple(s)) for n, s in data.get("tied_parameters", ())
                ),
                stage_to_rank=tuple(data.get("stage_to_rank", ())),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"not a plait plan ({type(e).__name__}: {e}); expected Plan.to_json() output") from e

    def __str__(self) -> str:
        lines = [
            f"plait plan: {self.num_stages} stage(s) on {self.world_size} rank(s), schedule "
            f"{self.schedule}, {self.num_microbatches} micro-batch(es), captured with "
            f"{self.capture_method}, {len(self.layer_names)} layers"
        ]
        for s in range(self.num_stages):
            names = self.stage_layers(s)
            shown = ", ".join(names) if len(names) <= 8 else (
                ", ".join(names[:3]) + f", ... ({len(names) - 6} more) ..., " + ", ".join(names[-3:])
            )
            lines.append(f"  stage {s} (rank {self.stage_to_rank[s]}): {len(names)} layers: {shown}")
        for name, stages in self.tied_parameters:
            lines.append(f"  tied parameter {name}: replicated on stages {list(stages)}, gradients summed")
        return "\n".join(lines)
