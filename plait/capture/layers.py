"""Grouping a captured graph's operations into layers, and the regions that cannot be cut.

A *layer* is one call of a leaf module (a module without children). Operations that belong to no
leaf module -- the functional code between layers -- join the layer before them (or the first
layer, if they come before any). Graph order is execution order, so a layer is a contiguous run::

    op:     emb  add  qkv  split  matmul  proj  add  head
    leaf:   emb  -    qkv  -      -       proj  -    head
    layer:  0    0    1    1      1       2     2    3

A leaf module with state (parameters or buffers) that is called again after other layers ran --
the cyclic case of the layer-dependency graph (nkflow §3.3.1) -- makes the layers from its first
to its last call one uncuttable region: cutting inside would make one stage take part in two data
flows. Stateless leaves (a shared `nn.ReLU`) may be called anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["LayerAssignment", "assign_layers"]


@dataclass(frozen=True)
class LayerAssignment:
    """Which layer each operation belongs to, and where cuts are forbidden."""

    layer_names: tuple[str, ...]
    op_layer: tuple[int, ...]  # op position -> layer index
    uncuttable: tuple[tuple[int, int], ...]  # inclusive layer ranges that must share one stage

    def valid_cut(self, after_layer: int) -> bool:
        """True if a stage boundary may fall between layer `after_layer` and the next one."""
        return all(not (a <= after_layer < b) for a, b in self.uncuttable)

    def region_of(self, after_layer: int) -> tuple[int, int] | None:
        """The uncuttable region a cut after `after_layer` would fall into, if any."""
        for a, b in self.uncuttable:
            if a <= after_layer < b:
                return (a, b)
        return None


def assign_layers(leaves: Sequence[str | None], stateful: set[str]) -> LayerAssignment:
    """Group ops into layers given each op's leaf module (None for functional code).

    leaves: for every op in execution order, the qualified name of the leaf module it runs in.
    stateful: the leaf modules that hold parameters or buffers.
    """
    starts: list[tuple[int, str]] = []  # (op position, leaf) where a new layer begins
    current: str | None = None
    for i, leaf in enumerate(leaves):
        if leaf is not None and leaf != current:
            starts.append((i, leaf))
            current = leaf
    if not starts:  # no leaf module at all: the whole graph is one layer
        return LayerAssignment(("<functional>",), tuple(0 for _ in leaves), ())

    calls: dict[str, int] = {}
    names: list[str] = []
    for _, leaf in starts:
        k = calls.get(leaf, 0)
        calls[leaf] = k + 1
        names.append(leaf if k == 0 else f"{leaf}#{k}")

    op_layer: list[int] = []
    layer = 0
    next_start = 1
    for i in range(len(leaves)):
        while next_start < len(starts) and starts[next_start][0] <= i:
            layer = next_start
            next_start += 1
        op_layer.append(layer)

    spans: dict[str, list[int]] = {}
    for index, (_, leaf) in enumerate(starts):
        spans.setdefault(leaf, []).append(index)
    regions = sorted(
        (idx[0], idx[-1]) for leaf, idx in spans.items() if leaf in stateful and idx[-1] > idx[0]
    )
    merged: list[tuple[int, int]] = []
    for a, b in regions:  # overlapping regions form one larger region
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return LayerAssignment(tuple(names), tuple(op_layer), tuple(merged))
