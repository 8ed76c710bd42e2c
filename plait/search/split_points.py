"""Cutting the layers at named modules: split points to layers per stage.

A split point is a module's qualified name (as in `net.named_modules()`); it starts a new stage
at the first captured layer that runs in that module. Layer names are module names, with "#k"
for the k-th further call of a module (`plait.capture.layers`):

    layer_names   wte  wpe  h.0.ln_1 ... h.0.proj  h.1.ln_1 ... h.1.proj  ln_f  lm_head
    index          0    1      2          7         8          13       14     15
    split_points = ["h.1"]          -> first layer in h.1 is 8 -> layers per stage (8, 8)
    split_points = ["h.0", "ln_f"]  -> starts at 2 and 14       -> (2, 12, 2)
"""

from __future__ import annotations

import difflib
from typing import Sequence

from plait.errors import PartitionError
from plait.search.partition import check_partition

__all__ = ["cut_at", "first_layer_in"]

HOW_TO_LIST = (
    "list the captured layers with plait.capture.trace.capture_batch(net, x).layers.layer_names "
    "(or model.plan.layer_names of a built model) and name a module of net.named_modules() that "
    "runs at least one of them"
)


def _module_of(layer_name: str) -> str:
    """The module a layer runs in: its name without the "#k" of a repeated call."""
    return layer_name.split("#", 1)[0]


def first_layer_in(point: str, layer_names: Sequence[str]) -> int | None:
    """Index of the first layer named `point` or run inside module `point` (None: no such layer).

    A layer matches when its name is `point` (so "block#1" names a module's second call) or its
    module is `point` or lies inside it ("h.1" holds "h.1.ln_1", not "h.10.ln_1").
    """
    for index, name in enumerate(layer_names):
        module = _module_of(name)
        if name == point or module == point or module.startswith(point + "."):
            return index
    return None


def _nearest(point: str, layer_names: Sequence[str]) -> list[str]:
    """The module names (every dotted prefix of a layer's module) closest to `point`."""
    prefixes: dict[str, None] = {}
    for name in layer_names:
        parts = _module_of(name).split(".")
        for k in range(1, len(parts) + 1):
            prefixes.setdefault(".".join(parts[:k]))
    return difflib.get_close_matches(point, list(prefixes), n=5, cutoff=0.5)


def cut_at(
    split_points: Sequence[str],
    layer_names: Sequence[str],
    uncuttable: Sequence[tuple[int, int]] = (),
) -> tuple[int, ...]:
    """Layers per stage when each of `split_points` starts a new stage (len + 1 stages).

    PartitionError names the point and the fix when a point matches no layer, when points are
    out of the model's order, when a stage would be empty, or (`check_partition`) when a cut
    falls inside an uncuttable region.
    """
    points = list(split_points)
    starts = []
    for point in points:
        start = first_layer_in(point, layer_names)
        if start is None:
            near = _nearest(point, layer_names)
            hint = f"the nearest module names are {near}" if near else "no module name is close"
            raise PartitionError(
                f"split point {point!r} (split_points={points}) matches no captured layer of the "
                f"model ({len(layer_names)} layers, from {layer_names[0] if layer_names else 'none'}"
                f" to {layer_names[-1] if layer_names else 'none'}); {hint}. To see them, {HOW_TO_LIST}"
            )
        starts.append(start)
    for i, start in enumerate(starts):
        where = f"layer {start} ({layer_names[start]})"
        if start == 0:
            raise PartitionError(
                f"split point {points[i]!r} starts at {where}, the model's first layer: the stage "
                f"before it would be empty; drop it from split_points={points}"
            )
        if i == 0:
            continue
        before = starts[i - 1]
        if start == before:
            raise PartitionError(
                f"split points {points[i - 1]!r} and {points[i]!r} both start at {where}: the "
                f"stage between them would be empty; drop one of them from split_points={points}"
            )
        if start < before:
            in_order = [p for _, p in sorted(zip(starts, points))]
            raise PartitionError(
                f"split point {points[i]!r} starts at {where}, before {points[i - 1]!r} "
                f"(layer {before}, {layer_names[before]}) listed ahead of it; list the points in "
                f"the model's order: split_points={in_order}"
            )
    bounds = [0, *starts, len(layer_names)]
    counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    try:
        check_partition(counts, layer_names, uncuttable)
    except PartitionError as error:
        raise PartitionError(f"split_points={points} (the cut layers_per_stage={list(counts)}): {error}") from None
    return counts
