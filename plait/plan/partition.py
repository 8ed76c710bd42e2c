"""Choosing contiguous layer ranges per stage, and checking a user's choice."""

from __future__ import annotations

from typing import Sequence

from plait.errors import PartitionError

__all__ = ["balance", "check_partition"]


def _cuts_allowed(num_layers: int, uncuttable: Sequence[tuple[int, int]]) -> list[bool]:
    """allowed[k]: a boundary may fall after layer k (0 <= k < num_layers - 1)."""
    return [all(not (a <= k < b) for a, b in uncuttable) for k in range(num_layers - 1)]


def balance(
    costs: Sequence[float], num_stages: int, uncuttable: Sequence[tuple[int, int]] = ()
) -> list[int]:
    """Layers per stage minimising the most expensive stage (contiguous, each stage >= 1 layer).

    An exact dynamic program over cut positions: best[s][i] = the smallest possible maximum stage
    cost when the first i layers form s stages. O(num_stages * n^2), n = len(costs).
    """
    n = len(costs)
    allowed = _cuts_allowed(n, uncuttable)
    if num_stages > n or num_stages < 1:
        raise PartitionError(
            f"cannot cut {n} layers into {num_stages} stages; use between 1 and {n} stages"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            if i < n and not allowed[i - 1]:
                continue  # a stage may not end after layer i-1
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    if best[num_stages][n] == inf:
        raise PartitionError(
            f"no way to cut {n} layers into {num_stages} stages without splitting an uncuttable "
            f"region {list(uncuttable)}; use fewer stages"
        )
    sizes = []
    i = n
    for s in range(num_stages, 0, -1):
        j = choice[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def check_partition(
    layers_per_stage: Sequence[int],
    layer_names: Sequence[str],
    uncuttable: Sequence[tuple[int, int]] = (),
) -> None:
    """Raise PartitionError naming the layers if `layers_per_stage` does not fit the model."""
    n = len(layer_names)
    listing = ", ".join(f"{i}:{name}" for i, name in enumerate(layer_names))
    if len(layers_per_stage) > n:
        raise PartitionError(
            f"{len(layers_per_stage)} stages but the model has only {n} layers ({listing}); "
            f"use at most {n} stages"
        )
    if sum(layers_per_stage) != n:
        raise PartitionError(
            f"layers_per_proc={list(layers_per_stage)} sums to {sum(layers_per_stage)} but the "
            f"model has {n} layers: {listing}. Give counts that sum to {n}, or "
            "layers_per_proc=None to balance automatically"
        )
    end = -1
    for size in layers_per_stage[:-1]:
        end += size
        for a, b in uncuttable:
            if a <= end < b:
                region = ", ".join(layer_names[a : b + 1])
                raise PartitionError(
                    f"layers_per_proc={list(layers_per_stage)} cuts after layer {end} "
                    f"({layer_names[end]}), inside an uncuttable region: layers {a}..{b} "
                    f"({region}) reuse a module and must stay on one stage. Move the cut before "
                    f"layer {a} or after layer {b}"
                )
