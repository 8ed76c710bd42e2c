"""The tp search: which splittable operations of each stage run split, chosen by an ILP.

The intra-operator ILP (`plait.search.tp_choice`) chooses when `Config.memory_limit_bytes` is given.

Without a limit every operation that can split does (Megatron's layout, `plait.capture.megatron_layout`).
With one, the ILP keeps whole what is cheaper whole -- compute against collectives, priced with
the device preset of the ranks' device (`plait.cost.devices`: "cpu" for CPU ranks, the GPU's
class for CUDA ones) -- as long as each stage's parameter state fits its share of the limit (the
limit over the chunks a rank holds); `tp_plan` entries are pins. The modules kept whole are
`tp_plan` "replicate" entries from then on, and the choice goes into the plan when it is resolved
(`plait.planner.resolve.complete_plan`); the runtime makes each stage's layout from it
(`plait.runtime.tp.layouts`), the evaluation pipeline too.

`tp_ops`: from the layout with everything split that can be (`plait.capture.megatron_layout`): each column- and
row-parallel linear and vocabulary-split embedding is one `TpOp` with its forward FLOPs (2 x the
output's elements x the contraction), the bytes of the parameters it splits, and the bytes its
collectives move; ops tied together are the column-parallel ones whose split a row-parallel one
(or a split output) reads, and those reading one weight. Sizes are the traced micro-batch's.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from plait.capture.graph_nodes import args_of, linear_parts, shape_of
from plait.capture.megatron_layout import strategy_of, tp_layouts
from plait.capture.shard_rules import Shard
from plait.capture.tp_layout import TpLayout, module_of
from plait.cost.devices import Device
from plait.cost.devices import device as device_preset
from plait.runtime.tp.layouts import planned_layouts
from plait.search.tp_choice import TpOp, TpSearch, choose_split
from plait.search.tp_strategies import TpMesh

__all__ = ["tp_ops", "searched_layouts", "device_search"]

aten = torch.ops.aten


def _bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    shape = shape_of(node)
    if not isinstance(val, torch.Tensor) or shape is None:
        return 0.0
    numel = 1
    for size in shape:
        numel *= max(size, 0)
    return float(numel * val.element_size())


def tp_ops(gm: fx.GraphModule, layout: TpLayout) -> tuple[list[TpOp], float]:
    """The layout's splittable ops, in graph order, and the parameter bytes the stage holds whole."""
    nodes = {n.name: n for n in gm.graph.nodes}
    params = dict(gm.named_parameters())
    counted: set[str] = set()
    reduced: set[fx.Node] = set()
    readers: dict[str, list[str]] = {}  # weight target -> the ops reading it
    gathered: dict[str, float] = {}  # op -> bytes of split values it starts that leave the stage
    gather_ties: list[frozenset[str]] = []
    for value in nodes["output"].all_input_nodes if "output" in nodes else ():
        lay = layout.values.get(value.name)
        if isinstance(lay, Shard) and lay.sources:
            first = min(lay.sources)
            gathered[first] = gathered.get(first, 0.0) + _bytes(value)
            gather_ties.append(lay.sources)

    def own(*targets: object) -> float:
        total = 0.0
        for target in targets:
            if isinstance(target, str) and target in params and target not in counted:
                counted.add(target)
                p = params[target]
                total += p.numel() * p.element_size()
        return float(total)

    ops: list[TpOp] = []
    for node in gm.graph.nodes:
        role = layout.roles.get(node.name)
        if role is None:
            continue
        if role == "vocab":
            weight = args_of(node)[0]
            readers.setdefault(str(weight.target), []).append(node.name)
            ops.append(TpOp(node.name, module_of(str(weight.target)), role, 0.0, own(weight.target),
                            forward_reduce_bytes=_bytes(node)))
            continue
        parts = linear_parts(node)
        assert parts is not None, f"{node.name} has role {role} but is no linear"
        readers.setdefault(str(parts.weight.target), []).append(node.name)
        contraction = (shape_of(parts.weight) or (0, 0))[parts.in_dim]
        out_elements = _bytes(node) / max(node.meta["val"].element_size(), 1)
        flops = 2.0 * out_elements * contraction
        bias = parts.bias.target if parts.bias is not None and role == "colwise" else None  # a row-parallel one's stays whole
        split_bytes = own(parts.weight.target, bias)
        ties: tuple[str, ...] = ()
        forward = backward = 0.0
        if role == "rowwise":
            forward = _bytes(node)
            lay = layout.values.get(parts.x.name)
            ties = tuple(sorted(lay.sources)) if isinstance(lay, Shard) else ()
        elif parts.x not in reduced:
            reduced.add(parts.x)
            backward = _bytes(parts.x)
        ops.append(TpOp(node.name, module_of(str(parts.weight.target)), role, flops, split_bytes, forward, backward,
                        gathered.get(node.name, 0.0), ties))
    extra: dict[str, set[str]] = {}
    for group in [*gather_ties, *(frozenset(r) for r in readers.values())]:
        for name in group:
            extra.setdefault(name, set()).update(group - {name})
    ops = [TpOp(op.name, op.module, op.role, op.flops, op.param_bytes, op.forward_reduce_bytes,
                op.backward_reduce_bytes, op.gather_bytes, tuple(sorted(set(op.ties) | extra.get(op.name, set()))))
           for op in ops]
    whole = sum(float(p.numel() * p.element_size()) for t, p in params.items() if t not in counted)
    return ops, whole


def device_search(memory_limit_bytes: float | None, tp: int, chunks_per_rank: int, device: torch.device,
                   state_factor: float) -> TpSearch | None:
    """The tp search for ranks on `device` (None without a memory limit: everything that splits does)."""
    if memory_limit_bytes is None or tp == 1:
        return None
    preset = preset_of(device)
    return TpSearch(TpMesh(tp, preset.network.intra, preset.flops), memory_limit_bytes / chunks_per_rank,
                    state_factor)


def preset_of(device: torch.device) -> Device:
    """The device preset nearest the ranks' `device` ("cpu" for CPU ranks)."""
    if device.type != "cuda":
        return device_preset("cpu")
    name = torch.cuda.get_device_name(device).lower()
    for key, preset in (("v100", "v100-16gb"), ("a100", "a100-80gb"), ("mi250", "mi250x"), ("h200", "h200-141gb")):
        if key in name:
            return device_preset(preset)
    return device_preset("h100-80gb")  # H100 and newer: the nearest preset


def searched_layouts(graphs: Sequence[fx.GraphModule], tp: int, tp_plan: Mapping[str, str] | None,
                     search: TpSearch | None, sequence_parallel: bool = False) -> list[TpLayout]:
    """Each stage's layout: everything split that can be, or (a `search`) what the ILP splits. A plan's
    choice is made again, without a search, by `plait.runtime.tp.layouts.planned_layouts`."""
    plan = dict(tp_plan or {})
    all_split = tp_layouts(graphs, tp, plan, sequence_parallel)  # everything split that can be
    chosen: list[dict[str, Any]] = []
    if search is not None:
        for g, lay in zip(graphs, all_split):
            ops, fixed = tp_ops(g, lay)
            if not ops:
                chosen.append({})
                continue
            pins = {op.name: op.role for op in ops if strategy_of(op.module, plan) is not None}
            split, solution = choose_split(ops, search, fixed, pins)
            chosen.append({"split": sorted({op.module for op in ops if op.name in split}),
                           "whole": sorted({op.module for op in ops if op.name not in split}), "ops": len(ops),
                           "state_bytes": solution.memory_bytes + fixed * search.state_factor,
                           "limit_bytes": search.memory_limit_bytes, "seconds": solution.total_s})
    return planned_layouts(graphs, tp, plan, chosen, sequence_parallel, all_split)
