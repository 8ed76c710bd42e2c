"""The planner's one choice: the search's inputs from a `Config`, and the layout picked from a priced search.

`Config()` (rank 0, `plait.planner.layout`) and `plait plan --model` (`plait.cli.plan_command`) both run

    Config, world, rows, optimizer, network, backend --search_inputs--> SearchInputs
    net + sample --plan_model(profile, search)--> PlanResult --choose--> Choice (the candidate, report)

so on the same profile they return the same layout. They differed: the command searched with
the "cpu" preset's link (50 us a message) where a job measures its backend's (2 gloo ranks on
2 cores: about 2 ms and 1 ms of the ranks' own time a hand-over), with the gradient sum hidden
behind the backward pass (gloo's is not: `local_cluster`), and without stages of different
widths among its choices: on a CNN it chose 32 micro-batches of ZB-H1 at a predicted 56 ms a
step, which ran at 258 ms, twice the 128 ms of what `Config(num_stages=2)` chose.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from plait.capture.trace import CapturedGraph
from plait.config import Config
from plait.schedule.registry import SEARCH_ORDER, schedule_spec
from plait.cost.network import Network
from plait.cost.prediction import Cluster
from plait.errors import ConfigError
from plait.planner.autoplan import PlanResult, local_cluster
from plait.planner.plan_report import PlanReport
from plait.planner.resolve import layout_keys
from plait.planner.widths import mixed_widths_choice
from plait.search.search import SearchSpace
from plait.search.tp_degree import tp_degrees

__all__ = ["SearchInputs", "Choice", "search_inputs", "search_space", "offload_choices", "choose"]


@dataclass(frozen=True)
class SearchInputs:
    """What the search may choose (`space`, and the tp degrees), what it prices with (`cluster`),
    and the source its report names ("planned": everything open; "partitioned": a given layout)."""

    space: SearchSpace
    cluster: Cluster
    tp: tuple[int, ...]
    source: str


@dataclass(frozen=True)
class Choice:
    """The chosen candidate's layout keys (`plait.planner.resolve.LAYOUT_KEYS`: what of it the run
    takes), and its report (table, alternatives, prediction)."""

    fields: dict[str, Any]
    report: PlanReport


def search_inputs(config: Config, world_size: int, global_batch: int, local_ranks: int,
                  optimizer_state_factor: float, network: Network | None, backend: str,
                  host: tuple[float, float] = (0.0, 0.0)) -> SearchInputs:
    """The search's inputs for `config` on `world_size` ranks, `local_ranks` of them on this host
    (its memory shared by them), pricing messages with `network` on `backend` ("gloo", "nccl");
    `host`: the ranks' host link and host memory bandwidth, bytes/s (GPU ranks; 0: CPU ranks)."""
    space, source = search_space(config, world_size, global_batch)
    cluster = local_cluster(local_ranks, network=network, memory_bytes=config.memory_limit_bytes,
                            optimizer_state_factor=optimizer_state_factor,
                            bucket_bytes=config.bucket_cap_mb * 2**20, backend=backend)
    cluster = replace(cluster, host_link=host[0], host_bandwidth=host[1])
    if config.recompute_by_layer is False:
        cluster = replace(cluster, recompute_by_layer=False)
    space = replace(space, offload=offload_choices(config.offload, cluster.host_link))
    tp = tp_degrees(world_size, local_ranks) if config.tp is None else (1,)  # a given tp: planned on its lanes
    return SearchInputs(space, cluster, tp, source)


def offload_choices(offload: str | bool | None, host_link: float) -> tuple[bool, ...]:
    """Config.offload as the search's choices: None tries it (taken where only it fits) on ranks
    beside a host (`host_link` > 0: GPUs), "optimizer" always, False never."""
    if offload is None:
        return (False, True) if host_link > 0 else (False,)
    return (offload == "optimizer",)


def search_space(config: Config, world_size: int, global_batch: int) -> tuple[SearchSpace, str]:
    """What the search may choose: everything open (Config()), or the layers of a given layout."""
    recompute = (False, True) if config.recompute is None else (config.recompute is True,)
    zero = None if config.zero is None else (config.zero,)
    zero3 = not config.replan and not config.compile  # zero=3 does not replan yet (Config.zero), nor compile
    if config.plans_everything:
        schedules = (config.schedule,) if config.schedule else tuple(SEARCH_ORDER)
        batched = (False, True) if config.batch_weight_grads is None and not config.compile else (
            config.batch_weight_grads is True,)
        return SearchSpace(schedules=schedules, recompute=recompute, zero=zero, zero3=zero3,
                           batch_weight_grads=batched), "planned"
    c = config.with_defaults()
    pp, v = c.stages_for(world_size), c.num_virtual_stages
    assert c.schedule is not None and c.num_microbatches is not None
    # One chunk per rank: the interleaved order is 1F1B's; more micro-batches than rows: clamped.
    one_chunk_as = schedule_spec(c.schedule).one_chunk_as
    schedule = one_chunk_as if one_chunk_as is not None and v < 2 else c.schedule
    m = min(c.num_microbatches, -(-global_batch // (world_size // pp)))
    return SearchSpace(pp=(pp,), num_microbatches=(m,), schedules=(schedule,), num_virtual_stages=max(v, 2),
                       recompute=recompute, zero=zero, zero3=zero3, batch_weight_grads=(c.batch_weight_grads is True,),
                       keep=1), "partitioned"


def choose(result: PlanResult, config: Config, world_size: int, source: str, captured: CapturedGraph | None,
           loss: Any = None, target: Any = None) -> Choice:
    """The layout `config` gets from a search's `result`: a pipeline of stages of different widths
    where one is predicted faster than any uniform layout (and the config allows it), else the best
    candidate; of a config that gave a layout, only the layers (and ZeRO) are taken. ConfigError
    where no layout fits."""
    best, cluster = result.best, result.cluster
    if not best.feasible:
        raise ConfigError(
            f"no layout of {world_size} ranks fits {cluster.memory_bytes / 2**30:.2f} GiB per rank "
            f"(Config.memory_limit_bytes={config.memory_limit_bytes}): {best.reason}"
        )
    mixed = None if captured is None else mixed_widths_choice(captured, config, world_size, result, cluster, loss, target)
    if mixed is not None:  # one pipeline of uneven stage widths, predicted faster than any uniform one
        return Choice(mixed[0], mixed[1])
    chosen = layout_keys(best.to_dict())
    if config.tp is not None:  # the user's tp: the search ran on its lanes
        chosen.pop("tp")
    if not config.plans_everything:  # the user's layout, with the planner's layers (and ZeRO) only
        by_layer = chosen["recompute_by_layer"] if config.recompute is True else []
        chosen = {"layers_per_stage": chosen["layers_per_stage"], "zero": chosen["zero"], "offload": chosen["offload"],
                  "recompute_by_layer": by_layer}
    if config.recompute_by_layer is not None:  # the user's, priced as given when False (`Cluster`)
        chosen.pop("recompute_by_layer", None)
    report = PlanReport(best.to_dict(), result.to_dict()["alternatives"], result.table(), source,
                        result.global_batch, result.profile.costs, cluster)
    return Choice(chosen, report)

