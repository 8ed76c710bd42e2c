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
    stage_to_rank: tuple[int, ...] = field(default=())  # replica 0's ranks
    dp: int = 1

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

    def rank_of(self, stage_index: int, replica: int) -> int:
        """The rank that runs `stage_index` of pipeline replica `replica`.

        Layout: rank = replica * num_stages + stage_index. A pipeline's stages are consecutive
        ranks, so neighbours (which exchange activations every micro-batch) share a node
        whenever a node holds a whole pipeline; replicas of a stage (which all-reduce once a
        step) are num_stages ranks apart. 2 stages x 3 replicas:

            replica 0: ranks 0 1 | replica 1: ranks 2 3 | replica 2: ranks 4 5
        """
        return replica * self.num_stages + stage_index

    def position_of(self, rank: int) -> tuple[int, int]:
        """(stage_index, replica) of a rank."""
        return rank % self.num_stages, rank // self.num_stages

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
                dp=int(data.get("dp", 1)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"not a plait plan ({type(e).__name__}: {e}); expected Plan.to_json() output") from e

    def __str__(self) -> str:
        lines = [
            f"plait plan: {self.num_stages} stage(s) x {self.dp} replica(s) on {self.world_size} "
            f"rank(s), schedule "
            f"{self.schedule}, {self.num_microbatches} micro-batch(es), captured with "
            f"{self.capture_method}, {len(self.layer_names)} layers"
        ]
        for s in range(self.num_stages):
            names = self.stage_layers(s)
            shown = ", ".join(names) if len(names) <= 8 else (
                ", ".join(names[:3]) + f", ... ({len(names) - 6} more) ..., " + ", ".join(names[-3:])
            )
            ranks = ", ".join(str(self.rank_of(s, r)) for r in range(self.dp))
            where = f"rank {ranks}" if self.dp == 1 else f"ranks {ranks}"
            lines.append(f"  stage {s} ({where}): {len(names)} layers: {shown}")
        for name, stages in self.tied_parameters:
            lines.append(f"  tied parameter {name}: replicated on stages {list(stages)}, gradients summed")
        return "\n".join(lines)
