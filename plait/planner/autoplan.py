"""Planning a model's layout from one sample batch: profile it here, then search (`plan_model`).

The data flow of the planner, each arrow a function of printable data:

    net + sample --profile--> LayerCosts --search(world, batch, Cluster)--> [Candidate, ...]

`plan_model` is what `Model` calls when a `Config` leaves sizes open, and what `plait plan
--model` runs; `PlanResult.config_fields()` gives the chosen layout as `Config` fields.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from plait import data as batching
from plait.capture.trace import CapturedGraph, capture, in_mode
from plait.cost.buckets import DEFAULT_BUCKET_BYTES, reduces_to_owners
from plait.cost.devices import device
from plait.cost.memory import held_in_precision, split_held_in_precision
from plait.cost.network import Network
from plait.cost.prediction import Cluster
from plait.errors import ConfigError
from plait.job.ranks import threads_per_rank
from plait.planner.profile import LayerProfile, OptimizerFactory, ProfileOptions, Slowest, profile
from plait.planner.tp_shares import tp_shares
from plait.search.search import Candidate, SearchSpace, format_table
from plait.search.tp_degree import search_tp

__all__ = ["PlanOptions", "PlanResult", "plan_model", "profile_sample", "local_cluster", "capture_sample"]

log = logging.getLogger("plait")


@dataclass(frozen=True)
class PlanOptions:
    """How to profile and what to search.

    profile_rows: rows of the sample to measure on (times are fitted affine in rows, so the
    search may price other micro-batch sizes). threads: intra-op threads per rank while
    measuring (None: this machine's cores shared by the local ranks, as `plait run` sets them).
    slowest: with every rank profiling at once, the reduction that makes each round's whole-model
    times the slowest rank's (`plait.runtime.comm.collectives.max_floats`; see `plait.planner.profile`).
    """

    space: SearchSpace = field(default_factory=SearchSpace)
    profile_rows: int = 64
    repeats: int = 5
    threads: int | None = None
    cache_dir: str | None = None
    reuse_profile: bool = True  # False: measure again even when a cached profile exists
    optimizer: OptimizerFactory = torch.optim.Adam
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    target: Any = None  # with `loss`: the sample's targets, so the last layer includes the loss
    slowest: Slowest | None = None
    captured: CapturedGraph | None = None  # the model as captured (train mode); None: capture here
    tp: tuple[int, ...] = (1,)  # the tensor-parallel degrees to consider (`plait.cost.tp_costs.tp_degrees`)
    tp_plan: tuple[tuple[str, str], ...] | None = None  # Config.tp_plan: its entries fix those modules
    precision: str = "fp32"  # Config.precision: the profile ran in it; its bytes are held as the run holds them


@dataclass(frozen=True)
class PlanResult:
    """The candidates best first, the profile they were priced with, and the cluster."""

    candidates: list[Candidate]
    profile: LayerProfile
    cluster: Cluster
    world_size: int
    global_batch: int

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def table(self, top: int = 5) -> str:
        return format_table(self.candidates, top)

    def to_dict(self) -> dict[str, Any]:
        """One JSON-ready object: the best candidate's fields, then the alternatives."""
        data = self.best.to_dict()
        data.update({
            "world_size": self.world_size, "global_batch": self.global_batch,
            "alternatives": [c.to_dict() for c in self.candidates[1:]],
            "profile": {"source": self.profile.costs.source, "seconds": self.profile.seconds,
                        "cached": self.profile.cached, "signature": self.profile.signature},
            "network": self.cluster.network.to_dict(),
            "memory_limit_bytes": self.cluster.memory_bytes,
        })
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def local_cluster(local_ranks: int, network: Network | None = None, memory_bytes: float | None = None,
                  optimizer_state_factor: float = 2.0, bucket_bytes: float = DEFAULT_BUCKET_BYTES,
                  backend: str = "") -> Cluster:
    """This machine as a cluster: its RAM shared by `local_ranks` processes (90% of it), and
    `network` (a `plait.planner.calibrate` measurement; default: the "cpu" preset's loopback).

    On `backend` gloo (CPU ranks, whose own cores move and sum the bytes while every core
    computes) the gradient sum is priced after the backward pass instead of beside it (measured
    on 2 gloo ranks: a 16 MiB all-reduce run beside 19 ms of compute hid 3-35% of its time), and
    ZeRO-2's sums as the runtime issues them (`plait.cost.buckets.reduces_to_owners`)."""
    if memory_bytes is None:
        try:
            total = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            total = device("cpu").memory_bytes
        memory_bytes = 0.9 * total / max(1, local_ranks)
    return Cluster(network or device("cpu").network, memory_bytes, optimizer_state_factor, bucket_bytes,
                   overlap_gradients=backend != "gloo", owner_reduces=reduces_to_owners(backend))


def profile_sample(net: nn.Module, sample: Any, world_size: int, options: PlanOptions = PlanOptions()) -> LayerProfile:
    """`profile` `net` on up to `options.profile_rows` rows of `sample` (a batch as `fit` takes it),
    with the threads each of `world_size` ranks will have. Leaves `net` as it was; cached by signature."""
    rows = batching.num_rows(sample)
    args, kwargs = _call_of(sample, options)
    target = options.target
    if target is not None:
        target = batching.slice_rows(target, 0, min(rows, options.profile_rows))
    return profile(net, args, kwargs, ProfileOptions(
        options.loss, target, options.repeats, options.optimizer,
        threads=options.threads or threads_per_rank(world_size), cache_dir=options.cache_dir,
        reuse=options.reuse_profile, slowest=options.slowest, captured=options.captured))


def plan_model(net: nn.Module, sample: Any, world_size: int, global_batch: int,
               cluster: Cluster, options: PlanOptions = PlanOptions()) -> PlanResult:
    """Profile `net` on (up to `options.profile_rows` rows of) `sample`, a batch as `fit` takes
    it, then search the layouts of `world_size` ranks for batches of `global_batch` rows.

    Runs on one process and leaves `net` as it was; the profile is cached by model signature.
    """
    if options.captured is None and any(tp > 1 for tp in options.tp):  # captured once, for both
        options = replace(options, captured=capture_sample(net, sample, options))
    measured = profile_sample(net, sample, world_size, options)
    measured = replace(measured, costs=held_in_precision(measured.costs, options.precision))
    shares = {}  # each tp priced on what the runtime's layout splits (`plait.planner.tp_shares`)
    for tp in (t for t in options.tp if t > 1):
        assert options.captured is not None
        try:
            shares[tp] = split_held_in_precision(tp_shares(options.captured, tp, dict(options.tp_plan or ()), options.loss,
                                                           options.target), options.precision)
        except ConfigError:
            raise  # the user's tp_plan does not fit: say so
        except Exception as e:  # noqa: BLE001 - a graph the layout cannot read: tp=1 only
            log.warning("plait: tp=%d not priced (%s: %s); planning without it", tp, type(e).__name__, e)
    found = search_tp(measured.costs, shares, world_size, global_batch, cluster, options.space, options.tp)
    return PlanResult(found, measured, cluster, world_size, global_batch)


def capture_sample(net: nn.Module, sample: Any, options: PlanOptions = PlanOptions()) -> CapturedGraph:
    """`net` captured as `plan_model` captures it: train mode, on the profiled rows of `sample`,
    the RNG left as it was."""
    with torch.random.fork_rng(), in_mode(net, True):
        return capture(net, *_call_of(sample, options))


def _call_of(sample: Any, options: PlanOptions) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The (args, kwargs) of the profiled rows of `sample`."""
    piece = batching.slice_rows(sample, 0, min(batching.num_rows(sample), options.profile_rows))
    return batching.as_call(piece)
