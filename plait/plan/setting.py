"""`Setting`: one point of the search space, with the rows and held micro-batches it implies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from plait.errors import ConfigError
from plait.plan.mesh import Mesh
from plait.schedule.registry import SCHEDULE_NAMES, schedule_spec, virtual_hint

__all__ = ["Setting", "microbatch_rows", "peak_activations", "check_zero", "ZERO_LEVELS", "SEARCHED_ZERO"]


ZERO_LEVELS = (0, 1, 2, 3)
SEARCHED_ZERO = (0, 1, 2, 3)  # the levels a search tries unless given (the lowest that fits is taken)


def check_zero(zero: object, dp: int) -> None:
    """ConfigError unless `zero` is 0, 1, 2 or 3, and above 0 only with more than one replica."""
    if isinstance(zero, bool) or zero not in ZERO_LEVELS:
        raise ConfigError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if zero and dp == 1:
        raise ConfigError(f"zero={zero} shards over a stage's replicas, but dp=1 has one replica; "
                          "set dp > 1 or zero=0")


@dataclass(frozen=True)
class Setting:
    """One point of the search space: degrees, micro-batches, schedule, recomputation, ZeRO
    (0: replicated state; 1: optimizer state sharded over the dp replicas; 2: gradients too)."""

    pp: int
    dp: int
    num_microbatches: int
    schedule: str = "1f1b"
    num_virtual_stages: int = 1
    recompute: bool = False
    zero: int = 0
    batch_weight_grads: bool = False  # linears' weight gradients once a step (`Config.batch_weight_grads`)
    offload: bool = False  # zero=3 with the shards, their gradients and the optimizer step in host memory

    def __post_init__(self) -> None:
        if not isinstance(self.batch_weight_grads, bool):
            raise ConfigError(f"batch_weight_grads must be True or False, got {self.batch_weight_grads!r}")
        for name in ("pp", "dp", "num_microbatches", "num_virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"schedule={self.schedule!r} is not known; choose one of {list(SCHEDULE_NAMES)}")
        if self.num_virtual_stages > 1 and not schedule_spec(self.schedule).virtual:
            raise ConfigError(
                f"num_virtual_stages={self.num_virtual_stages} needs {virtual_hint()}"
            )
        check_zero(self.zero, self.dp)
        if self.offload is not False and (self.offload is not True or self.zero != 3):
            raise ConfigError(f"offload={self.offload!r} with zero={self.zero}; offload is True or False, and "
                              "True only with zero=3 (it moves the shards and their optimizer to host memory)")

    @property
    def num_chunks(self) -> int:
        """Model stages (chunks): pp x num_virtual_stages."""
        return self.pp * self.num_virtual_stages

    @cached_property
    def mesh(self) -> Mesh:
        """The ranks of this setting (tp = 1): pp x dp of them."""
        return Mesh(world_size=self.pp * self.dp, pp=self.pp, dp=self.dp, num_virtual_stages=self.num_virtual_stages)

    def rank_of(self, stage_index: int, replica: int) -> int:
        """The rank running a stage of a replica: the `Mesh`'s layout."""
        return self.mesh.rank_of(stage_index, replica)



def microbatch_rows(global_batch: int, dp: int, num_microbatches: int) -> int:
    """Rows of the largest micro-batch: the batch split over dp replicas, then m micro-batches."""
    return math.ceil(math.ceil(global_batch / dp) / num_microbatches)


def peak_activations(setting: Setting) -> tuple[float, ...]:
    """Micro-batches each rank holds at once: the schedule's closed form
    (`ScheduleSpec.peak_activations`: GPipe m, 1F1B stage s min(p - s, m), ZB-H1 min(p, m),
    interleaved by its warmup), or every micro-batch with batched weight gradients. A test checks
    all four against `simulate` on the generators' programs."""
    p, m, v = setting.pp, setting.num_microbatches, setting.num_virtual_stages
    if setting.batch_weight_grads:  # batched: every micro-batch's inputs kept
        return (float(m),) * p
    return schedule_spec(setting.schedule).peak_activations(p, m, v, setting.recompute)
