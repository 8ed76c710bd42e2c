"""Gradient buckets: which gradients are all-reduced together, in which order, and the time to sum them (pure).

The runtime (`plait.runtime.dp.grad_sync`) fills its buckets by this rule and issues a collective for
each gradient of ALONE_BYTES or more and one for the rest of each bucket; the cost model prices
each collective's latency and the last bucket's all-reduce, which can only start when the
backward pass has ended.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from plait.cost.network import Link, all_reduce

__all__ = ["FIRST_BUCKET_BYTES", "DEFAULT_BUCKET_BYTES", "ALONE_BYTES", "assign_buckets", "reduces_to_owners",
           "bucket_summary", "summed_in"]

FIRST_BUCKET_BYTES = 2**20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_BYTES = 25 * 2**20  # Config.bucket_cap_mb's default, as DistributedDataParallel's
ALONE_BYTES = 4 * 2**20  # a gradient this large is reduced where autograd put it, not copied into a bucket


def reduces_to_owners(backend: str) -> bool:
    """Whether ZeRO-2's buckets are reduced to their owners on `backend`, as the runtime issues them
    and the cost model prices them: not on gloo, whose reduce ran slower than its all-reduce inside
    a step (the mlp of benchmarks/tp_planner.py: 334 ms a step with reduces, 272 with all-reduces,
    ZeRO-1 258), so the buckets are all-reduced there; NCCL's reduce moves half an all-reduce's bytes."""
    return backend != "gloo"


def assign_buckets(sizes: Sequence[float], dtypes: Sequence[Any], cap: float) -> list[list[int]]:
    """Indices of the tensors (in launch order) in each bucket, as DistributedDataParallel does.

    A bucket takes tensors until it holds at least its cap -- FIRST_BUCKET_BYTES (or `cap`, if
    smaller) for the first, `cap` for the others -- the tensor that crosses the cap included;
    a tensor of another dtype starts a new bucket. So the first bucket holds the last layer's
    weight, not just its bias, and its all-reduce overlaps the rest of the backward pass.
    """
    buckets: list[list[int]] = []
    size, closed = 0.0, True
    for i, (nbytes, dtype) in enumerate(zip(sizes, dtypes)):
        if closed or dtypes[buckets[-1][-1]] != dtype:
            buckets.append([])
            size = 0.0
        buckets[-1].append(i)
        size += nbytes
        limit = min(cap, FIRST_BUCKET_BYTES) if len(buckets) == 1 else cap
        closed = size >= limit
    return buckets


def bucket_summary(grad_bytes: Sequence[float], cap: float) -> tuple[float, int]:
    """(bytes of the last bucket, collectives in all) for layers with `grad_bytes` (forward order),
    filled in backward order by `assign_buckets`, a layer's gradients counted as one tensor: per
    bucket, one collective for each layer of ALONE_BYTES or more (reduced where it lies) and one
    for the others together, if any (a large layer's small tensors, e.g. its bias, are not seen)."""
    sizes = [float(b) for b in reversed(grad_bytes) if b > 0]
    buckets = assign_buckets(sizes, [None] * len(sizes), cap)
    if not buckets:
        return 0.0, 0
    collectives = 0
    for bucket in buckets:
        large = sum(1 for i in bucket if sizes[i] >= ALONE_BYTES)
        collectives += large + (large < len(bucket))
    return sum(sizes[i] for i in buckets[-1]), collectives


def summed_in(collectives: int, nbytes: float, num_devices: int, link: Link,
              gradient_sum: Callable[[float, int, Link], float] = all_reduce) -> float:
    """Seconds to sum `nbytes` of gradients over `num_devices` in `collectives` collectives (the
    runtime's, `bucket_summary`): the bytes once, and each collective's latency (a byte's sum)."""
    if nbytes <= 0:
        return 0.0
    return gradient_sum(nbytes, num_devices, link) + max(collectives - 1, 0) * gradient_sum(1.0, num_devices, link)
