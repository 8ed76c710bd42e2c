"""`Setting`: one point of the search space, with the rows and held micro-batches it implies."""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.config import SCHEDULE_NAMES
from plait.errors import ConfigError
from plait.schedule.interleaved import group_sizes

__all__ = ["Setting", "microbatch_rows", "peak_activations", "check_zero", "ZERO_LEVELS"]


ZERO_LEVELS = (0, 1, 2)


def check_zero(zero: object, dp: int) -> None:
    """ConfigError unless `zero` is 0, 1 or 2, and 1 or 2 only with more than one replica."""
    if isinstance(zero, bool) or zero not in ZERO_LEVELS:
        raise ConfigError(f"zero must be 0, 1 or 2, got {zero!r}")
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

    def __post_init__(self) -> None:
        if not isinstance(self.batch_weight_grads, bool):
            raise ConfigError(f"batch_weight_grads must be True or False, got {self.batch_weight_grads!r}")
        for name in ("pp", "dp", "num_microbatches", "num_virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"schedule={self.schedule!r} is not known; choose one of {list(SCHEDULE_NAMES)}")
        if self.num_virtual_stages > 1 and self.schedule != "interleaved":
            raise ConfigError(
                f"num_virtual_stages={self.num_virtual_stages} needs schedule='interleaved'"
            )
        check_zero(self.zero, self.dp)

    @property
    def num_chunks(self) -> int:
        """Model stages (chunks): pp x num_virtual_stages."""
        return self.pp * self.num_virtual_stages

    def rank_of(self, stage_index: int, replica: int) -> int:
        """The rank running a stage of a replica: `Plan.rank_of`'s layout."""
        return replica * self.pp + stage_index % self.pp



def microbatch_rows(global_batch: int, dp: int, num_microbatches: int) -> int:
    """Rows of the largest micro-batch: the batch split over dp replicas, then m micro-batches."""
    return math.ceil(math.ceil(global_batch / dp) / num_microbatches)


def peak_activations(setting: Setting) -> tuple[float, ...]:
    """Micro-batches each rank holds at once: GPipe m (Huang et al. 2019), 1F1B stage s
    min(p - s, m) (Narayanan et al. 2021), ZB-H1 min(p, m) (Qi et al. 2023; F done, W not yet).
    Interleaved: rank r runs w = 2(p - r - 1) + (v - 1)G warmup forwards (G the largest
    micro-batch group; all m v when m = p) and then holds one more chunk before its first
    backward; a chunk counts 1/v. A test checks all four against `simulate` on the generators'
    programs."""
    p, m, v = setting.pp, setting.num_microbatches, setting.num_virtual_stages
    if setting.schedule == "gpipe" or setting.batch_weight_grads:  # batched: every micro-batch's inputs kept
        return (float(m),) * p
    if setting.schedule == "1f1b" or (setting.schedule == "zbh1" and setting.recompute):
        return tuple(float(min(p - s, m)) for s in range(p))
    if setting.schedule == "zbh1":
        return (float(min(p, m)),) * p
    chunks, largest = m * v, max(group_sizes(m, p))
    peaks = []
    for r in range(p):
        warmup = chunks if m == p else min(2 * (p - r - 1) + (v - 1) * largest, chunks)
        peaks.append((warmup + 1 if warmup < chunks else chunks) / v)
    return tuple(peaks)
