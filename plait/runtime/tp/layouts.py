"""A plan's tensor-parallel layouts made again on this rank's stage graphs: the planner's choice, applied."""

from __future__ import annotations

import glob
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch.fx as fx

from plait.capture.graph_nodes import args_of
from plait.capture.megatron_layout import embedding_nodes, tp_layouts
from plait.capture.split import StageModule
from plait.capture.tp_layout import TpLayout, module_of
from plait.plan import Plan
from plait.runtime.widths.stage_widths import kept_whole

__all__ = ["KEPT_WHOLE", "WHOLE", "planned_layouts", "width_groups", "stage_layouts", "layouts_data"]

KEPT_WHOLE = "kept whole by the tp search: cheaper whole, and the stage fits memory_limit_bytes"


def planned_layouts(graphs: Sequence[fx.GraphModule], tp: int, tp_plan: Mapping[str, str] | None,
                    chosen: Sequence[Mapping[str, Any]] = (), sequence_parallel: bool = False,
                    split: Sequence[TpLayout] | None = None) -> list[TpLayout]:
    """Each stage's layout: everything split that can be (Megatron's layout, with `tp_plan`'s pins), or,
    where the tp search chose (`chosen`: each stage's {"split", "whole", ...}, as the plan holds it),
    its whole modules kept whole. Deterministic: every rank, and the evaluation pipeline, make the
    same layouts from the same plan; nothing is decided here. `split`: `tp_layouts` of these graphs
    and `tp_plan` (everything split that can be), where the caller has made them already."""
    plan = dict(tp_plan or {})
    layouts = list(split) if split is not None else tp_layouts(graphs, tp, plan, sequence_parallel)
    chosen = [dict(c) for c in chosen] or [{} for _ in graphs]
    if not any(chosen):
        return layouts
    whole = {m for c in chosen for m in c.get("whole", ())}
    vocab = {module_of(str(args_of(n)[0].target)) for g, lay in zip(graphs, layouts)
             for n in g.graph.nodes if lay.roles.get(n.name) == "vocab"}
    unsplit = {module_of(str(args_of(n)[0].target)) for g in graphs for n in embedding_nodes(g)} - vocab  # stay whole when the search drops the vocab split
    extended = {**plan, **{glob.escape(m): "replicate" for m in sorted(whole | unsplit) if m not in plan}}
    final = tp_layouts(graphs, tp, extended, sequence_parallel)
    return [replace(lay, replicated=lay.replicated + tuple((m, KEPT_WHOLE) for m in c.get("whole", ())), search=dict(c))
            for lay, c in zip(final, chosen)]


WHOLE: dict[str, Any] = {"parameters": {}, "collectives": [], "replicated": {}}  # the layout of a stage of one rank


def width_groups(stages: Sequence[StageModule], plan: Plan) -> list[tuple[int, list[int], dict[str, str]]]:
    """(tp width, its stages, their tp_plan) for each width over one rank: the stages of one width are
    laid out together (a parameter tied across them is cut alike; one tied to a stage of another
    width stays whole, `kept_whole`)."""
    whole = kept_whole(stages, plan) if plan.stage_tp else {}
    out = []
    for width in sorted({plan.tp_of(s) for s in range(plan.num_chunks)} - {1}):
        chosen = [s for s in range(plan.num_chunks) if plan.tp_of(s) == width]
        out.append((width, chosen, {**dict(plan.tp_plan), **{m: "replicate" for s in chosen for m in whole.get(s, ())}}))
    return out


def stage_layouts(stages: Sequence[StageModule], plan: Plan) -> dict[int, TpLayout]:
    """The layout of every stage of more than one rank, as the plan's tp layouts chose it (a plan
    without them: Megatron's, what the planner gives without a memory limit)."""
    out: dict[int, TpLayout] = {}
    for width, chosen, tp_plan in width_groups(stages, plan):
        earlier = [dict(plan.tp_layouts[s].get("search") or {}) for s in chosen] if plan.tp_layouts else []
        out.update(zip(chosen, planned_layouts([stages[s].module for s in chosen], width, tp_plan, earlier,
                                               plan.sequence_parallel)))
    return out


def layouts_data(stages: Sequence[StageModule], layouts: Mapping[int, TpLayout]) -> tuple[dict[str, Any], ...]:
    """`Plan.tp_layouts`: each stage's layout as data (a stage of one rank: nothing split)."""
    return tuple(layouts[s].data(st.module) if s in layouts else dict(WHOLE) for s, st in enumerate(stages))
