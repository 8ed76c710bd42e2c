"""`memory_stats`: one rank's memory by kind, measured, beside the planner's prediction of each.

Measured (bytes, this rank):

    parameters_bytes         the parameters it holds (its stages'; the others are freed, on meta);
                             in low precision the fp32 masters and the copies the stages compute with
    buffers_bytes            its buffers
    gradients_bytes          the gradient buffers after the last step's backward (the peak: with
                             ZeRO-2 too, since gradients accumulate over the micro-batches)
    gradients_at_step_bytes  those still held at its optimizer step (ZeRO-2: its share only)
    optimizer_bytes          the optimizer's state (ZeRO 1 and 2: of its share)
    activations_peak_bytes   the most held for backward passes at once in the last step
                             (`plait.runtime.memory.activation_meter`)
    device_peak_bytes        on a GPU: the allocator's peak in the last step (every kind at once)

Predicted, under "predicted": the same kinds by `plait.cost.memory` from this rank's parameter
bytes (the layout's ZeRO level and the optimizer's state factor), and the activations by the
planner's profile where the planner chose the layout (None where the layout was given).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.capture.compute_dtype import dtype_of
from plait.cost.memory import optimizer_state_factor, state_bytes
from plait.runtime.pipeline import Pipeline
from plait.runtime.step import held_bytes

__all__ = ["memory_line", "memory_stats", "state_factor"]

# memory_stats' key -> the planner's per-rank list in its chosen candidate (`plait.search.search`)
_PLANNED = {"parameters_bytes": "parameter_bytes", "gradients_bytes": "gradient_bytes",
            "optimizer_bytes": "optimizer_bytes", "activations_peak_bytes": "activation_bytes"}


def memory_stats(pipe: Pipeline, net: nn.Module, readings: dict[str, int | None], state_factor: float,
                 chosen: dict[str, Any] | None) -> dict[str, Any]:
    """This rank's measured bytes by kind, with "predicted" beside them (see the module)."""
    params: list[torch.Tensor] = list({id(p): p for p in net.parameters() if not p.is_meta}.values())
    buffers = {id(b): b for b in net.buffers() if not b.is_meta}.values()
    copies = pipe.copies.copy_bytes if pipe.copies is not None else 0  # Plan.precision below fp32
    if pipe.sharded is not None:  # zero=3: the shards, and what stays whole (the user's sharded ones hold nothing)
        params = [*(s.to_local() for s in pipe.sharded.parameters if isinstance(s, DTensor)),
                  *(p for p in params if p.untyped_storage().nbytes())]
    measured: dict[str, Any] = {
        "parameters_bytes": sum(p.numel() * p.element_size() for p in params) + copies,
        "buffers_bytes": held_bytes(buffers),
        **{key: readings.get(key) for key in ("gradients_bytes", "gradients_at_step_bytes",
                                               "optimizer_bytes", "activations_peak_bytes")},
    }
    if "device_peak_bytes" in readings:
        measured["device_peak_bytes"] = readings["device_peak_bytes"]
    local = pipe.local_parameters
    plan = pipe.plan
    position = plan.mesh.coordinates(pipe.rank).position
    dp = plan.dp_of(position)  # stage_dp: a stage of one replica shards nothing
    low = dtype_of(plan.precision).itemsize if plan.precision != "fp32" else 0  # a copy of each floating parameter
    sharded = set(map(id, pipe.sharded.parameters)) if pipe.sharded is not None else set()

    def held(p: torch.Tensor) -> int:
        """A parameter's bytes and its low copy's (zero=3: FSDP2 gathers a shard's copy per piece, then frees it)."""
        return p.numel() * (p.element_size() + (low if p.is_floating_point() and id(p) not in sharded else 0))

    state = state_bytes(float(sum(held(p) for p in local)),
                        float(sum(p.numel() * p.element_size() for p in local if p.requires_grad)),
                        state_factor, dp, plan.zero if dp > 1 else 0)
    predicted: dict[str, float | None] = {
        "parameters_bytes": state.parameters, "gradients_bytes": state.gradients,
        "gradients_at_step_bytes": state.step_gradients, "optimizer_bytes": state.optimizer,
        "activations_peak_bytes": None,
    }
    if chosen is not None and not plan.stage_tp and int(chosen.get("tp", 1) or 1) != plan.tp:
        chosen = None  # a given tp: planned on its lanes at tp=1, whose bytes are not this run's
    if chosen is not None and chosen.get("activation_bytes"):  # the planner's, from its profile
        for key, planned in _PLANNED.items():
            predicted[key] = float(chosen[planned][position])
    if pipe.sharded is not None:  # zero=3: a parameter tied across stages stays whole on every holder
        kept = float(sum(held(p) for p in local if id(p) not in sharded))
        predicted["parameters_bytes"] = float(predicted["parameters_bytes"] or 0.0) + kept * (1 - 1 / dp)
    measured["predicted"] = predicted
    return measured


def memory_line(stats: dict[str, Any], rank: int) -> str:
    """One line of `memory_stats`: each kind measured / predicted, in MiB ("-": not predicted)."""
    def mib(value: float | None) -> str:
        return "-" if value is None else f"{value / 2**20:.2f}"

    kinds = [("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"),
             ("optimizer", "optimizer_bytes"), ("activations", "activations_peak_bytes")]
    parts = [f"{label} {mib(stats[key])} / {mib(stats['predicted'][key])}" for label, key in kinds]
    return f"memory of rank {rank} (MiB, measured / predicted): " + ", ".join(parts)


def state_factor(optimizer: Any) -> float:
    """Optimizer state bytes per fp32 gradient byte of an optimizer instance (`optimizer_state_factor`
    of its kind: Adam 2, SGD with momentum 1, SGD 0)."""
    if isinstance(optimizer, torch.optim.SGD):
        return optimizer_state_factor("sgd-momentum" if optimizer.defaults.get("momentum") else "sgd", 4)
    return optimizer_state_factor("adam", 4)  # Adam, or a factory we cannot look into: the larger, to be safe
