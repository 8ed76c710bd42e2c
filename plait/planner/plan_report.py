"""`PlanReport`: what the planner chose for a run, its alternatives, and how the run measured up.

`model.plan_report` holds one when the layout came from the cost model (or a planner file).
Printed, it is the planner's table (per stage: layers, time, memory; then the alternatives)
followed, once the first steps ran, by the measured-vs-predicted check. `to_json()` is the
same JSON `plait plan -o` writes, so `Config(plan=path)` replays it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plait.config.aliases import new_names
from plait.cost.buckets import DEFAULT_BUCKET_BYTES
from plait.cost.network import Network
from plait.cost.prediction import Cluster, Prediction, Setting, predict
from plait.plan.layer_costs import LayerCosts
from plait.search.feedback import Feedback

__all__ = ["PlanReport"]


@dataclass(frozen=True)
class PlanReport:
    """The chosen candidate (`chosen`, a `Candidate.to_dict()`), the alternatives, and the
    profile and cluster they were priced with (None when replayed from a file)."""

    chosen: dict[str, Any]
    alternatives: list[dict[str, Any]]
    table: str
    source: str  # "planned", "partitioned", or "plan file PATH"
    global_batch: int
    costs: LayerCosts | None = None
    cluster: Cluster | None = None
    feedback: Feedback | None = None
    history: tuple[str, ...] = ()  # earlier layouts of this run (replans)

    @property
    def predicted_stage_s(self) -> list[float]:
        """Predicted F + B + W of one micro-batch on each stage."""
        return [float(s["time_s"]) for s in self.chosen.get("stages", [])]

    @property
    def predicted_step_s(self) -> float | None:
        value = self.chosen.get("predicted_step_time_s")
        return None if value is None else float(value)

    @property
    def zero(self) -> int:
        """The chosen ZeRO level (0 in a report saved before plait priced ZeRO)."""
        return int(self.chosen.get("zero", 0) or 0)

    def setting(self) -> Setting:
        c = self.chosen
        return Setting(int(c["pp"]), int(c["dp"]), int(c["num_microbatches"]), str(c["schedule"]),
                       int(c.get("num_virtual_stages", 1)), bool(c.get("recompute", False)), self.zero,
                       bool(c.get("batch_weight_grads", False)))

    def prediction(self) -> Prediction:
        """The chosen layout's prediction, priced again from the profile (planned runs only)."""
        assert self.costs is not None and self.cluster is not None
        cluster = replace(self.cluster, ride_sums=int(self.chosen.get("tp", 1) or 1) == 1)  # tp lanes: all-reduced
        return predict(self.costs, self.setting(), cluster, self.global_batch,
                       self.chosen["layers_per_stage"], simulate=True)

    def to_dict(self) -> dict[str, Any]:
        """The chosen candidate's fields, the alternatives, the profile and the check, JSON-ready."""
        data = dict(self.chosen)
        data["alternatives"] = self.alternatives
        data["global_batch"] = self.global_batch
        data["source"] = self.source
        if self.costs is not None and self.cluster is not None:
            data["costs"] = self.costs.to_dict()
            data["cluster"] = {"network": self.cluster.network.to_dict(),
                               "memory_bytes": self.cluster.memory_bytes,
                               "optimizer_state_factor": self.cluster.optimizer_state_factor,
                               "bucket_bytes": self.cluster.bucket_bytes,
                               "overlap_gradients": self.cluster.overlap_gradients,
                               "owner_reduces": self.cluster.owner_reduces,
                               "recompute_by_layer": self.cluster.recompute_by_layer}
        if self.feedback is not None:
            data["feedback"] = self.feedback.to_dict()
        if self.history:
            data["earlier_layouts"] = list(self.history)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], table: str) -> "PlanReport":
        """The inverse of `to_dict` (the check is not read back: it belongs to the run)."""
        chosen = new_names({k: v for k, v in data.items() if k not in (  # a report saved with tp_per_stage, ...
            "alternatives", "global_batch", "source", "costs", "cluster", "feedback", "earlier_layouts")}, "plan report")
        costs = LayerCosts.from_dict(data["costs"]) if "costs" in data else None
        cluster = None
        if "cluster" in data:
            c = data["cluster"]
            cluster = Cluster(Network.from_dict(c["network"]), float(c["memory_bytes"]),
                              float(c["optimizer_state_factor"]), float(c.get("bucket_bytes", DEFAULT_BUCKET_BYTES)),
                              bool(c.get("overlap_gradients", True)), bool(c.get("owner_reduces", True)),
                              bool(c.get("recompute_by_layer", True)))
        return cls(chosen, list(data.get("alternatives", [])), table, str(data.get("source", "")),
                   int(data["global_batch"]), costs, cluster, history=tuple(data.get("earlier_layouts", ())))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `to_json()` to `path`: `Config(plan=path)` replays the layout."""
        out = Path(path)
        out.write_text(self.to_json())
        return out

    def __str__(self) -> str:
        lines = [f"plait planner ({self.source}), global batch {self.global_batch}:", self.table]
        if self.feedback is not None:
            lines.append(self.feedback.summary())
        lines.extend(f"earlier layout: {h}" for h in self.history)
        return "\n".join(lines)
