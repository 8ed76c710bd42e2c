"""Per-layer F, B, W of a `Setting` and the terms of the closed form the partition minimises.

A layer's backward runs as the setting makes it: whole (B + W), split (ZB-H1's W apart),
recomputed (the forward again first) or, with batched weight gradients, B alone per micro-batch
and W once over all of them after the rank's last action (`flush_times`). Cached by the costs'
identity: the search prices one model thousands of times.
"""

from __future__ import annotations

from functools import lru_cache

from plait.plan.layer_costs import LayerCosts
from plait.plan.setting import Setting, microbatch_rows
from plait.schedule.registry import schedule_spec
from plait.schedule.spec import ClosedForm

__all__ = ["DEFERRED_HOLD", "layer_times", "flush_times", "latency_terms", "latency_count", "fill_share",
           "recomputed_memory", "hold", "pipeline_lower_bound"]

# batch_weight_grads keeps each linear's input and output gradient of every micro-batch until the
# step's end: the inputs are among the activations, the output gradients counted as as many again.
DEFERRED_HOLD = 2.0


class _Same:
    """A `LayerCosts` keyed by identity: the search prices one model's costs thousands of times,
    and hashing its per-layer tuples would cost more than the lists the caches below keep."""

    __slots__ = ("costs",)

    def __init__(self, costs: LayerCosts) -> None:
        self.costs = costs

    def __hash__(self) -> int:
        return id(self.costs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.costs is self.costs


@lru_cache(maxsize=256)
def _times(same: _Same, rows: int, mode: str) -> tuple[list[float], list[float], list[float]]:
    """F, B, W per layer; mode "recompute", "split" (ZB-H1) or "whole"; "deferred" and
    "deferred-recompute" leave W out (batched: `flush_times`). Shared: do not mutate."""
    costs = same.costs
    f, b, w = costs.forward(rows), costs.backward(rows), costs.weight(rows)
    if mode.startswith("deferred"):  # W runs once a step, after the last micro-batch
        return f, [x + y for x, y in zip(f, b)] if mode == "deferred-recompute" else b, [0.0] * len(w)
    if mode == "recompute":  # the forward again before the backward, which runs B and W together
        b = [x + y + z for x, y, z in zip(f, b, w)]
        w = [0.0] * len(w)
    elif mode == "whole":
        b = [x + y for x, y in zip(b, w)]
        w = [0.0] * len(w)
    return f, b, w


def flush_times(costs: LayerCosts, setting: Setting, rows: int) -> list[float]:
    """Each layer's weight gradient over all m micro-batches at once (batch_weight_grads), else 0."""
    if not setting.batch_weight_grads:
        return [0.0] * costs.num_layers
    return costs.weight(rows * setting.num_microbatches)


def _modes(setting: Setting) -> tuple[str, str]:
    """How `setting` runs a layer's backward (`_times`), and which closed form times it (`_terms`).
    Batched weight gradients: no W per micro-batch, so ZB-H1 times as 1F1B. Interleaved with
    fewer micro-batches than ranks times as a plain pipeline of all its chunks: a micro-batch
    passes every chunk in turn before the next can fill it, (p v + m - 1) chunk times for
    uniform chunks against Megatron's (m v + p - 1) once m >= p (the schedule's simulation
    gives the larger of the two). The schedule's spec says how it splits and which form it has."""
    spec = schedule_spec(setting.schedule)
    interleaved = spec.closed_form is ClosedForm.INTERLEAVED and setting.num_microbatches >= setting.pp
    if setting.batch_weight_grads:
        mode = "deferred-recompute" if setting.recompute else "deferred"
        return mode, "megatron" if interleaved else "plain"
    mode = "recompute" if setting.recompute else ("split" if spec.splits_backward else "whole")
    if mode == "split" and spec.closed_form is ClosedForm.ZERO_BUBBLE:
        return mode, "zero-bubble" if setting.num_microbatches >= setting.pp else "zero-bubble-few"
    return mode, "megatron" if interleaved else "plain"


def fill_share(setting: Setting) -> float:
    """The share of each chunk's time its fill counts: 1/v where the closed form is Megatron's."""
    return 1 / setting.num_virtual_stages if _modes(setting)[1] == "megatron" else 1.0


def layer_times(costs: LayerCosts, setting: Setting, rows: int) -> tuple[list[float], list[float], list[float]]:
    return _times(_Same(costs), rows, _modes(setting)[0])


def latency_terms(costs: LayerCosts, setting: Setting, rows: int) -> tuple[list[float], list[float], list[float], float]:
    """Per-layer (bottleneck time, fill, last-stage fill) and the bottleneck count of the
    schedule's closed form (see `partition_problem`). Shared lists: do not mutate."""
    mode, kind = _modes(setting)
    time, fill, last_fill = _terms(_Same(costs), rows, mode, kind, setting.num_virtual_stages, _batched_m(setting))
    return time, fill, last_fill, latency_count(setting)


def latency_count(setting: Setting) -> float:
    """How many times the closed form counts the slowest chunk (`latency_terms`' last value)."""
    m = setting.num_microbatches
    return float(m * setting.num_virtual_stages - 1 if _modes(setting)[1] == "megatron" else m - 1)


def _batched_m(setting: Setting) -> int:
    """The micro-batches one batched weight gradient covers (0: not batched)."""
    return setting.num_microbatches if setting.batch_weight_grads else 0


@lru_cache(maxsize=256)
def _terms(same: _Same, rows: int, mode: str, kind: str, v: int,
           batched_m: int = 0) -> tuple[list[float], list[float], list[float]]:
    """Per-layer (bottleneck time, fill, last-stage fill). Batched weight gradients (`batched_m`
    micro-batches' W at once) count 1/m in the bottleneck and 1/m on the last stage: once in all
    for uniform stages, (p + m - 1)(F + B) + W."""
    f, b, w = _times(same, rows, mode)
    if batched_m:
        w = [x / batched_m for x in same.costs.weight(rows * batched_m)]
        busy = [x + y for x, y in zip(f, b)]
        return [x + z for x, z in zip(busy, w)], [x / v for x in busy] if kind == "megatron" else busy, w
    time = [x + y + z for x, y, z in zip(f, b, w)]
    if kind == "zero-bubble":
        return time, [x + y - z for x, y, z in zip(f, b, w)], [2 * z for z in w]
    if kind == "zero-bubble-few":
        busy = [x + y for x, y in zip(f, b)]  # fewer micro-batches than stages: W never waits
        return busy, busy, list(w)
    if kind == "megatron":
        return time, [t / v for t in time], [0.0] * len(time)
    return time, list(time), [0.0] * len(time)


@lru_cache(maxsize=1024)
def _sums(same: _Same, rows: int, mode: str, kind: str, v: int, batched_m: int) -> tuple[float, float]:
    time, fill, _ = _terms(same, rows, mode, kind, v, batched_m)
    return sum(fill), sum(time)


def recomputed_memory(setting: Setting) -> bool:
    """Whether only stage inputs are held (recomputation, its weight gradients not batched)."""
    return setting.recompute and not setting.batch_weight_grads


def hold(setting: Setting) -> float:
    """Bytes held per activation byte of each held micro-batch."""
    return DEFERRED_HOLD if setting.batch_weight_grads else 1.0


def pipeline_lower_bound(costs: LayerCosts, setting: Setting, global_batch: int) -> float:
    """A bound no layout of `setting` beats: its closed form with free hand-overs, no last-stage
    extra and a slowest stage no slower than the average one (max >= mean)."""
    rows = microbatch_rows(global_batch, setting.dp, setting.num_microbatches)
    v, m = setting.num_virtual_stages, setting.num_microbatches
    mode, kind = _modes(setting)
    fill, time = _sums(_Same(costs), rows, mode, kind, v, _batched_m(setting))
    return fill + float(m * v - 1 if kind == "megatron" else m - 1) * time / setting.num_chunks
