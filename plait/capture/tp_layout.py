"""`TpLayout`: one stage graph's tensor-parallel layout as data, and its report in DTensor's words.

Which operations run split and how every value and parameter is split, as
`plait.capture.megatron_layout` finds them on the captured graph; the runtime shards a stage by it
(`plait.runtime.tp.tensor_parallel`) and the plan carries its report (`TpLayout.data`).
`TP_STRATEGIES` and `TP_PLACEMENT` are the values `Config(tp_plan=...)` accepts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from plait.capture.graph_nodes import args_of, linear_parts
from plait.capture.shard_rules import Layout, Shard, seq_operands

__all__ = ["TpLayout", "module_of", "TP_STRATEGIES", "TP_PLACEMENT"]

# Config.tp_plan's values: a strategy, or the weight's placement in DTensor's words
TP_STRATEGIES = ("colwise", "rowwise", "vocab", "replicate")
TP_PLACEMENT = re.compile(r"Shard\((\d)\)|Replicate\(\)")

aten = torch.ops.aten


@dataclass(frozen=True)
class TpLayout:
    """One stage graph's tensor-parallel layout on `tp` ranks.

    roles: node name -> "colwise" | "rowwise" | "vocab" (an embedding split by rows).
    params: get_attr target -> (dim, blocks) of the parameter's split.
    values: node name -> its Layout (None: whole on every rank).
    replicated: (module, why) of each linear left whole.
    """

    tp: int
    roles: dict[str, str] = field(default_factory=dict)
    params: dict[str, tuple[int, int]] = field(default_factory=dict)
    values: dict[str, Layout] = field(default_factory=dict)
    replicated: tuple[tuple[str, str], ...] = ()
    search: dict[str, Any] = field(default_factory=dict)  # the tp search's choice (plait.planner.tp_search)
    seq_entries: dict[str, tuple[str, int]] = field(default_factory=dict)  # rowwise -> (value, dim) reduce-scattered
    gathers: frozenset[str] = frozenset()  # nodes whose token-split inputs are gathered first

    def describe(self) -> list[str]:
        """The split parameters by strategy, and the linears left whole with the reason."""
        lines = []
        for target, (dim, blocks) in sorted(self.params.items()):
            part = f" in {blocks} blocks" if blocks > 1 else ""
            lines.append(f"{module_of(target)}.{target.rsplit('.', 1)[-1]}: split on dim {dim}{part}")
        lines += [f"{name}: replicated ({why})" for name, why in self.replicated]
        return lines


    def _layout_of(self, value: Any) -> Layout:
        return self.values.get(value.name) if isinstance(value, fx.Node) else None

    def data(self, gm: fx.GraphModule) -> dict[str, Any]:
        """JSON-ready, in DTensor's words, for the plan: each split parameter's placement on the tp
        axis (Shard(dim), in `blocks` blocks), each graph value's that is not Replicate() (a split
        activation; a row-parallel product: Partial(), all-reduced at once), the collectives the
        runtime inserts (kind, pass, where, why), and the linears left whole with the reason (a
        parameter or value not listed: Replicate())."""
        params = {f"{module_of(t)}.{t.rsplit('.', 1)[-1]}": {"placement": f"Shard({d})", "blocks": b}
                  for t, (d, b) in sorted(self.params.items())}
        collectives: list[dict[str, str]] = []
        copied: set[fx.Node] = set()
        why = {"rowwise": "partial sums: Partial() -> Replicate() (Megatron's g)",
               "vocab": "each rank's vocabulary rows looked up: Partial() -> Replicate()"}
        entries = {value for value, _ in self.seq_entries.values()}
        gathered: set[fx.Node] = set()

        def add(kind: str, where: str, at: str, because: str) -> None:
            collectives.append({"kind": kind, "pass": where, "at": at, "why": because})

        for node in gm.graph.nodes:
            role = self.roles.get(node.name)
            if node.name in self.gathers:
                for value in node.all_input_nodes:
                    lay = self.values.get(value.name)
                    if isinstance(lay, Shard) and lay.seq and value not in gathered:
                        gathered.add(value)
                        if gathered_for_colwise(self, value):
                            add("all_gather", "forward", node.name, f"Shard({lay.dim}) over the tokens -> Replicate() "
                                "for column-parallel linears (sequence parallel f)")
                            add("reduce_scatter", "backward", node.name, "their input gradients' shares summed, "
                                "each rank keeping its tokens'")
                            copied.update([value, *(u for u in value.users if u.name in self.gathers)])
                        else:
                            add("all_gather", "forward", node.name, f"Shard({lay.dim}) over the tokens -> "
                                f"Replicate(): {node.target} reads them whole (backward: this rank's part)")
            if not role and node.name not in entries:
                for value, need, dim in seq_operands(node, self.values.get(node.name), self._layout_of):
                    if need == "scatter":
                        add("all_gather", "backward", node.name, f"{value.name} Replicate() -> Shard({dim}) over the "
                            "tokens, a local part; its gradient all-gathered")
                    else:
                        add("all_reduce", "backward", node.name, f"{value.name} broadcast over split tokens: each "
                            "rank's gradient covers its own")
            if role in ("colwise", "rowwise"):
                parts = linear_parts(node)
                assert parts is not None
                at = module_of(str(parts.weight.target))
                if role == "rowwise" and node.name in self.seq_entries:
                    dim = self.seq_entries[node.name][1]
                    add("reduce_scatter", "forward", at, f"partial sums: Partial() -> Shard({dim}) over the tokens "
                        "(sequence parallel; backward: all-gather)")
                elif role == "rowwise":
                    collectives.append({"kind": "all_reduce", "pass": "forward", "at": at, "why": why[role]})
                elif parts.x not in copied:
                    copied.add(parts.x)
                    collectives.append({"kind": "all_reduce", "pass": "backward", "at": at,
                                        "why": "the replicated input's gradient (Megatron's f)"})
            elif role == "vocab":
                at = module_of(str(args_of(node)[0].target))
                collectives.append({"kind": "all_reduce", "pass": "forward", "at": at, "why": why[role]})
            elif node.op == "output":
                for value in node.all_input_nodes:
                    lay = self.values.get(value.name)
                    if isinstance(lay, Shard) and lay.seq:
                        add("all_gather", "forward", value.name, f"Shard({lay.dim}) over the tokens -> Replicate() "
                            "as it leaves the stage")
                        continue
                    if isinstance(lay, Shard):
                        collectives.append({"kind": "all_gather", "pass": "forward", "at": value.name,
                                            "why": f"Shard({lay.dim}) -> Replicate() as it leaves the stage"})
        activations: dict[str, str] = {}  # each split value of the graph, and each partial sum
        for node in gm.graph.nodes:
            lay = self.values.get(node.name)
            lays = lay if isinstance(lay, tuple) else (lay,)
            shown = [_placement(x) for x in lays]
            if any(x != "Replicate()" for x in shown):
                activations[node.name] = shown[0] if len(shown) == 1 else "(" + ", ".join(shown) + ")"
            if node.name in self.seq_entries:
                activations[node.name] = f"Partial() -> Shard({self.seq_entries[node.name][1]})"
            elif self.roles.get(node.name) in ("rowwise", "vocab"):
                activations[node.name] = "Partial() -> Replicate()"
        found = {"parameters": params, "collectives": collectives, "replicated": dict(self.replicated)}
        return {**found, **{key: value for key, value in (("activations", activations), ("search", self.search))
                            if value}}


def _placement(lay: Layout) -> str:
    if isinstance(lay, Shard):
        return f"Shard({lay.dim})" + (f" in {lay.blocks} blocks" if lay.blocks > 1 else "") + (" tokens" if lay.seq else "")
    return "Replicate()"


VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def gathered_for_colwise(layout: TpLayout, value: fx.Node) -> bool:
    """Whether every operation `layout` gathers token-split `value` for reads it only as a column-
    parallel linear's input (or views it for those): their input gradients are each rank's share,
    so the gather's backward is a reduce-scatter and they need no all-reduce of their own."""
    def feeds(user: fx.Node, source: fx.Node) -> bool:
        if layout.roles.get(user.name) == "colwise":
            parts = linear_parts(user)
            return parts is not None and parts.x is source
        return (user.op == "call_function" and user.target in VIEWS and bool(user.users)
                and all(feeds(u, user) for u in user.users))
    readers = [u for u in value.users if u.name in layout.gathers]
    return bool(readers) and all(feeds(u, value) for u in readers)


def module_of(target: str) -> str:
    """The user's module name of a captured parameter ("net.h.0.mlp.c_fc.weight" -> "h.0.mlp.c_fc")."""
    return target.removeprefix("net.").rsplit(".", 1)[0]
