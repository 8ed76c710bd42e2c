"""Recomputation layer by layer: a stage's graph cut into its layers' pieces, each piece checkpointed.

A stage recomputed whole (`torch.utils.checkpoint` around the stage) keeps only its input per
micro-batch, but while its backward recomputes the forward it holds every layer's activations of
that micro-batch at once. Cut into pieces (`torch.fx.passes.split_module`; a piece is a repeated
block's layers, `plait.cost.recompute_pieces`) with each piece under its own checkpoint, the
stage keeps each piece's input per micro-batch and, in the backward, recomputes and frees one
piece at a time -- Megatron-LM's full recomputation: a transformer layer's input kept, one
layer's activations alive. The pieces run in the order of their dependencies (split_module's
topological order: a value made early and first used by a later block, a mask or a rotary table,
goes with that block). They read the stage's parameters; each checkpoint restores the RNG state,
so dropout draws the same mask when it recomputes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from plait.capture.split import LAYER

__all__ = ["layer_checkpointed", "layer_parts"]


class _Checkpointed(nn.Module):
    """One piece, its forward run again by the backward that needs its activations."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False)


def layer_parts(graph: fx.Graph, layer_pieces: Sequence[int]) -> dict[fx.Node, int]:
    """Each node's piece: its layer's, never before its inputs' pieces; a node of no layer (a
    parameter read, a size, a collective the tp layout added) goes with its inputs, else with
    its first user."""
    part: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op not in ("placeholder", "output"):
            own = layer_pieces[node.meta[LAYER]] if LAYER in node.meta else -1
            part[node] = max([own] + [part.get(x, -1) for x in node.all_input_nodes])
    first = min((p for p in part.values() if p >= 0), default=0)
    for node in reversed(list(graph.nodes)):
        if part.get(node) == -1:
            users = [part[u] for u in node.users if part.get(u, -1) >= 0]
            part[node] = min(users, default=first)
    order = {p: i for i, p in enumerate(sorted(set(part.values())))}
    return {node: order[p] for node, p in part.items()}


def layer_checkpointed(module: fx.GraphModule, layer_pieces: Sequence[int]) -> nn.Module:
    """`module` cut into its layers' pieces (`layer_pieces[layer]`, `plait.cost.recompute_pieces`),
    every piece under its own checkpoint."""
    part = layer_parts(module.graph, layer_pieces)
    if len(set(part.values())) <= 1:
        return _Checkpointed(module)
    parent = split_module(module, module, part.__getitem__)
    for name, child in list(parent.named_children()):
        if name.startswith("submod_"):
            setattr(parent, name, _Checkpointed(child))
    return parent
