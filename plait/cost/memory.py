"""Model-state memory of a rank: its parameters, gradients and optimizer state, with or without ZeRO.

The one home of these formulas: the cost model prices layouts with them (`plait.cost.prediction`), and
the runtime's memory accounting should count the same bytes. For a rank whose stages hold P bytes
of parameters and G bytes of gradients, an optimizer keeping k bytes of state per gradient byte
(Adam in fp32: 2; mixed-precision Adam with its fp32 master copy: 6), and dp replicas per stage
(Rajbhandari et al. 2020, ZeRO, with the runtime's `plait.runtime.dp.zero`):

    zero   parameters   gradients (backward)   gradients (optimizer step)   optimizer state
    0      P            G                      G                            k G
    1      P            G                      G                            k G / dp
    2      P            G                      G / dp                       k G / dp
    3      P / dp       G                      G / dp                       k G / dp
    3 + offload  0      G                      0                            0

With a split backward (ZB-H1) at zero=3 a piece's parameters stay gathered from a micro-batch's B
until its W (and the next forward frees them): in the last micro-batches the whole stage's are
gathered at once, in their compute dtype (C: the low copies' bytes, else P), held beside the
gradients: the backward's column reads G + C.

With offload (`Config.offload`, FSDP2's CPUOffloadPolicy) the device holds no shard: the shards,
their reduce-scattered gradients and the optimizer state are in host memory (P / dp + G / dp +
k G / dp of it), each piece's parameters copied to the device for its gather; its gradients still
add up whole on the device over the micro-batches.

ZeRO-2 reduces each gradient bucket to the owners of its parameters, but the stage's gradients
all exist during the backward (they accumulate over micro-batches), so its peak -- the
backward's, with the activations on top -- is ZeRO-1's; only the optimizer step runs lighter.
ZeRO-3 (`plait.runtime.dp.sharded_params`) holds 1/dp of the parameters; its gradients add up whole
over the micro-batches until the last one's backward reduce-scatters them (one piece's whole
parameters, gathered for its forward or backward, are left out as the activations' working set):

    peak = max(P + G + optimizer + activations,   P + step gradients + optimizer)

The runtime shares parameters out whole, balanced by bytes: a replica's share is modelled as
exactly 1/dp (close whenever a stage has many parameters). Parameters tied across stages are
not sharded (every holder steps them); they are small and left out here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from plait.cost.tp_costs import TpShares
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import check_zero

__all__ = ["StateBytes", "state_bytes", "state_totals", "optimizer_state_factor", "held_in_precision",
           "split_held_in_precision"]

def optimizer_state_factor(optimizer: str, dtype_bytes: int) -> float:
    """Optimizer state bytes per gradient byte. Mixed precision (2-byte gradients) adds an fp32
    master copy: Adam 12 bytes per 2-byte gradient = 6, fp32 Adam 8 per 4 = 2 (ZeRO's 16 bytes
    per parameter in both cases, with parameters and gradients)."""
    state = {"adam": 8, "sgd-momentum": 4, "sgd": 0}
    if optimizer not in state:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of {sorted(state)}")
    master = 4 if dtype_bytes < 4 else 0
    return (state[optimizer] + master) / dtype_bytes


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state one rank holds (see the module's table)."""

    parameters: float
    gradients: float  # the peak: during the backward
    optimizer: float
    step_gradients: float  # during the optimizer step (ZeRO-2: this replica's share only)

    @property
    def total(self) -> float:
        """Parameters + gradients + optimizer state at the peak (the backward's, activations aside)."""
        return max(self.parameters + self.gradients + self.optimizer,
                   self.parameters + self.step_gradients + self.optimizer)

    def peak(self, activation_bytes: float) -> float:
        """The rank's peak with `activation_bytes` held in the backward (none in the step)."""
        return max(self.parameters + self.gradients + self.optimizer + activation_bytes,
                   self.parameters + self.step_gradients + self.optimizer)


def state_bytes(param_bytes: float, grad_bytes: float, optimizer_state_factor: float,
                dp: int, zero: int, copy_bytes: float = 0.0, offload: bool = False, gathered: bool = False) -> StateBytes:
    """The device's state bytes of a rank whose stages hold `param_bytes` (`copy_bytes` of them
    low-precision copies: zero=3 holds only the masters' shards) and `grad_bytes`; `offload`
    (zero=3): the shards and the optimizer's in host memory; `gathered` (zero=3 with a split
    backward): the stage's parameters gathered beside the gradients at the backward's end."""
    _check(optimizer_state_factor, dp, zero)
    return _state(param_bytes, grad_bytes, optimizer_state_factor, dp, zero, copy_bytes, offload, gathered)


def state_totals(param_bytes: Sequence[float], grad_bytes: Sequence[float], optimizer_state_factor: float,
                 dp: int, zero: int, copy_bytes: Sequence[float] = (), offload: bool = False,
                 gathered: bool = False) -> list[float]:
    """`state_bytes(...).total` of each layer (the partition's fixed memory), checked once."""
    _check(optimizer_state_factor, dp, zero)
    # `_state(...).total` of every layer at once: the same float operations, element-wise
    params, grads = np.asarray(param_bytes, dtype=np.float64), np.asarray(grad_bytes, dtype=np.float64)
    copies = np.asarray(copy_bytes, dtype=np.float64) if len(copy_bytes) else np.zeros_like(params)
    held = grads + (np.where(copies > 0, copies, params) if zero == 3 and gathered else 0.0)
    if offload and zero == 3:  # the device holds the gradients alone (`_state`)
        return [float(x) for x in held.tolist()]
    optimizer = optimizer_state_factor * grads / (dp if zero else 1)
    step = grads / dp if zero >= 2 else grads
    if zero == 3:
        params = (params - copies) / dp
    totals = np.maximum(params + held + optimizer, params + step + optimizer)
    return [float(x) for x in totals.tolist()]


def _check(optimizer_state_factor: float, dp: int, zero: int) -> None:
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"dp must be a positive integer, got {dp!r}")
    check_zero(zero, dp)
    if not (math.isfinite(optimizer_state_factor) and optimizer_state_factor >= 0):
        raise ConfigError(f"optimizer_state_factor must be >= 0 (Adam: 2), got {optimizer_state_factor!r}")


def _state(param_bytes: float, grad_bytes: float, optimizer_state_factor: float, dp: int, zero: int,
           copy_bytes: float = 0.0, offload: bool = False, gathered: bool = False) -> StateBytes:
    """The module's table (arguments checked)."""
    held = grad_bytes + ((copy_bytes or param_bytes) if zero == 3 and gathered else 0.0)
    if offload and zero == 3:
        return StateBytes(parameters=0.0, gradients=held, optimizer=0.0, step_gradients=0.0)
    return StateBytes(
        parameters=(param_bytes - copy_bytes) / dp if zero == 3 else param_bytes,
        gradients=held,
        optimizer=optimizer_state_factor * grad_bytes / (dp if zero else 1),
        step_gradients=grad_bytes / dp if zero >= 2 else grad_bytes,
    )


HELD_PER_CAPTURED = 3.0  # a parameter captured in 2 bytes is held as a 4-byte master beside its 2-byte copy


def held_in_precision(costs: LayerCosts, precision: str) -> LayerCosts:
    """A profile taken with the parameters held in a 2-byte `precision` ("bf16", "fp16"), its bytes
    as the run holds them: each parameter as an fp32 master beside its copy (4 + 2 bytes: 3 times
    the profiled 2) and each gradient in fp32 (2 times); the optimizer state follows the fp32
    gradients. Buffers, profiled with the parameters, count 3 times too (they are small). fp32: as it is."""
    if precision == "fp32":
        return costs
    return replace(costs, param_bytes=tuple(HELD_PER_CAPTURED * b for b in costs.param_bytes),
                   grad_bytes=tuple(2.0 * b for b in costs.grad_bytes), copy_bytes=costs.param_bytes)


def split_held_in_precision(shares: TpShares, precision: str) -> TpShares:
    """Tensor parallelism's split parameter bytes of a graph captured in a 2-byte `precision`, as
    the run holds them (`held_in_precision`: 3 times the captured 2 bytes); fp32: as they are."""
    if precision == "fp32":
        return shares
    return replace(shares, split_bytes=tuple(HELD_PER_CAPTURED * b for b in shares.split_bytes))
