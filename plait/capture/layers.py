"""Grouping a captured graph's operations into layers, and the regions that cannot be cut.

A *layer* is one call of a leaf module (a module without children). Operations that belong to no
leaf module -- the functional code between layers -- join the layer before them (or the first
layer, if they come before any). Graph order is execution order, so a layer is a contiguous run::

    op:     emb  add  qkv  split  matmul  proj  add  head
    leaf:   emb  -    qkv  -      -       proj  -    head
    layer:  0    0    1    1      1       2     2    3

A module called again after other layers ran -- the cyclic case of the layer-dependency graph,
layer reuse (nkflow §3.3.1): ALBERT's one shared layer called at every depth, a universal
transformer's loop, a weight-shared block -- is cuttable between its calls. Each call is its own
layer (`name`, `name#1`, ...), and every stage that calls it holds its parameters, tied: their
gradients are summed over those stages, as a tied embedding's are (runtime/pipeline.py)::

    layers:   emb   block   block#1   block#2   head        block's weights live on both
    stages:   0     0       1         1         1           stages, gradients summed

A reused leaf with buffers (a batch norm's running statistics, which each call updates in turn)
makes the layers from its first to its last call one uncuttable region instead: the updates of
one module split over two ranks would diverge. Stateless leaves (a shared `nn.ReLU`) may be
called anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

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


def assign_layers(leaves: Sequence[str | None], buffered: set[str],
                  call_ids: Sequence[Hashable] | None = None) -> LayerAssignment:
    """Group ops into layers given each op's leaf module (None for functional code).

    leaves: for every op in execution order, the qualified name of the leaf module it runs in.
    buffered: the leaf modules that hold buffers (a reused one cannot be cut between its calls).
    call_ids: for every op, which call of its leaf it belongs to, so that a module called twice in a
    row (`block(block(x))`, or with only functional code between) makes two layers; without it a
    new layer starts where the leaf changes.
    """
    starts: list[tuple[int, str]] = []  # (op position, leaf) where a new layer begins
    current: tuple[str | None, Hashable] | None = None
    for i, leaf in enumerate(leaves):
        call = (leaf, call_ids[i] if call_ids is not None else None)
        if leaf is not None and call != current:
            starts.append((i, leaf))
            current = call
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
        (idx[0], idx[-1]) for leaf, idx in spans.items() if leaf in buffered and idx[-1] > idx[0]
    )
    merged: list[tuple[int, int]] = []
    for a, b in regions:  # overlapping regions form one larger region
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return LayerAssignment(tuple(names), tuple(op_layer), tuple(merged))
