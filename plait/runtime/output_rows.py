"""Joining predict's output leaves: per-row leaves along the rows, the others as a list per micro-batch.

A leaf of the model's output is *per row* when its first dimension is the batch's and no other
dimension depends on it: the micro-batches' values are then the rows of the batch's value, and
`torch.cat` makes it. Other leaves cannot be joined like that: CLIP's `logits_per_image` is
(image rows x text rows) per micro-batch, the similarities within it, and the batch's would hold
every pair::

    micro-batch 0: (2 x 2)   micro-batch 1: (1 x 1)      cat: fails (or, equal sizes, a wrong (4 x 2))
    predict returns [(2 x 2), (1 x 1), ...]: one value per micro-batch, in row order

torch.export keeps the batch dimension symbolic, so the captured output says which leaves are per
row (`row_leaves`); a torch.fx capture does not, and there a leaf counts as per row when its
first dimension is each micro-batch's rows and the others are alike (micro-batches of equal rows
cannot tell a (rows x rows) leaf from a per-row one there).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from plait.capture.trace import CapturedGraph

__all__ = ["row_leaves", "join_microbatches", "join_parts", "leaf_names"]


def row_leaves(captured: CapturedGraph) -> tuple[bool, ...] | None:
    """Whether each output leaf is per row, read off the captured graph's symbolic shapes (None
    where the capture kept none: torch.fx, or a batch dimension made concrete)."""
    batch: set[Any] = set()
    for node in captured.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            batch |= _symbols(val.shape[0])
    output = next(n for n in captured.graph.nodes if n.op == "output")
    leaves = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    if not batch:
        return None
    out = []
    for leaf in leaves:
        val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        out.append(val.dim() > 0 and bool(_symbols(val.shape[0]) & batch)
                   and not any(_symbols(d) & batch for d in val.shape[1:]))
    return tuple(out)


def _symbols(size: Any) -> set[Any]:
    """The free symbols of one (symbolic) size; none for a plain int."""
    node = getattr(size, "node", None)
    return set(node.expr.free_symbols) if node is not None and hasattr(node, "expr") else set()


def join_microbatches(outputs: Sequence[list[Any]], rows: Sequence[int],
                      per_row: Sequence[bool] | None) -> list[Any]:
    """The flat output leaves of consecutive micro-batches of `rows` rows each, joined: a per-row
    leaf along the rows, another tensor as the list of its values, anything else the first's."""
    joined: list[Any] = []
    for i, first in enumerate(outputs[0]):
        values = [leaves[i] for leaves in outputs]
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            joined.append(first)
        elif (per_row[i] if per_row is not None
              else all(v.dim() > 0 and v.shape[0] == n and v.shape[1:] == first.shape[1:]
                       for v, n in zip(values, rows))):
            joined.append(torch.cat(values))
        else:
            joined.append(list(values))
    return joined


def join_parts(parts: Sequence[list[Any]]) -> list[Any]:
    """Leaves joined by `join_microbatches` for consecutive row ranges (replicas, batches), joined
    alike: tensors along the rows, lists one after the other, anything else the first's."""
    joined: list[Any] = []
    for i, first in enumerate(parts[0]):
        if isinstance(first, list):
            joined.append([v for part in parts for v in part[i]])
        elif isinstance(first, torch.Tensor) and first.dim() > 0:
            joined.append(torch.cat([part[i] for part in parts]))
        else:
            joined.append(first)
    return joined


def leaf_names(spec: Any, prefix: str = "output") -> list[str]:
    """The name of each leaf of an output spec (`plait.capture.output`): output.logits_per_image, output[1]."""
    kind = spec[0]
    if kind == "leaf":
        return [prefix]
    if kind == "seq":
        return [n for i, c in enumerate(spec[2]) for n in leaf_names(c, f"{prefix}[{i}]")]
    if kind == "map":
        return [n for k, c in zip(spec[2], spec[3]) for n in leaf_names(c, f"{prefix}[{k!r}]")]
    if kind == "dataclass":
        return [n for k, c in zip(spec[2], spec[3]) for n in leaf_names(c, f"{prefix}.{k}")]
    return []
