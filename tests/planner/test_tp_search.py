"""Tests for plait.planner.tp_search: the splittable ops of a Hugging Face GPT-2 stage graph, and the
layouts the tp search gives under memory limits -- the ILP's choice (brute force's), the modules it
keeps whole, tp_plan pins, the choice replayed from the plan. One process, no collectives."""

from __future__ import annotations

import json

import pytest
import torch

from plait.capture.megatron_layout import tp_layouts
from plait.capture.tp_layout import module_of
from plait.cost.devices import device
from plait.plan import Plan
from plait.planner.tp_search import device_search, searched_layouts, tp_ops
from plait.runtime.tp.layouts import KEPT_WHOLE, planned_layouts
from plait.search.intra_op import brute_force
from plait.search.tp_choice import TpSearch, tp_graph
from tests.capture.test_tp_layout import _graphs, gpt2

pytest.importorskip("transformers")
CPU = device("cpu")
FACTOR = 4.0  # parameter, gradient and Adam's two moments


def _search(limit: float) -> TpSearch:
    search = device_search(limit, 2, 1, torch.device("cpu"), FACTOR)
    assert search is not None
    return search


def _state(gm: torch.fx.GraphModule, params: dict[str, tuple[int, int]]) -> float:
    """The stage's parameter state on one of 2 ranks under a layout's split parameters."""
    return FACTOR * sum(p.numel() * p.element_size() / (2 if t in params else 1) for t, p in gm.named_parameters())


def test_gpt2_ops_are_its_linears_and_word_embedding_with_their_collectives_and_ties() -> None:
    [g] = _graphs(gpt2())
    [layout] = tp_layouts([g], 2)
    ops, whole = tp_ops(g, layout)
    by_module = {(op.module, op.role): op for op in ops}
    assert len(ops) == 10  # 2 x (q|k|v, attention out, MLP up, MLP down), the word embedding, the head
    hidden = 2 * 8 * 32 * 4  # the traced micro-batch's hidden states, fp32
    for i in range(2):
        qkv, out = by_module[(f"transformer.h.{i}.attn.c_attn", "colwise")], by_module[(f"transformer.h.{i}.attn.c_proj", "rowwise")]
        assert qkv.flops == 2.0 * 16 * 32 * 96 and qkv.param_bytes == (32 * 96 + 96) * 4
        assert qkv.backward_reduce_bytes == hidden and out.forward_reduce_bytes == hidden
        assert out.ties == (qkv.name,) and out.param_bytes == 32 * 32 * 4  # its bias stays whole
    embedding, head = by_module[("lm_head", "vocab")], by_module[("lm_head", "colwise")]  # one tied weight
    assert embedding.ties == (head.name,) and head.ties == (embedding.name,)
    assert embedding.param_bytes == 64 * 32 * 4 and head.param_bytes == 0  # counted once
    assert head.gather_bytes == 2 * 8 * 64 * 4  # the logits leave the stage split
    kept = [p for t, p in g.named_parameters() if "ln_" in t or "wpe" in t or "c_proj.bias" in t]
    assert whole == sum(p.numel() * 4 for p in kept)


def test_no_limit_or_one_rank_is_no_search() -> None:
    assert device_search(None, 2, 1, torch.device("cpu"), FACTOR) is None
    assert device_search(1e9, 1, 1, torch.device("cpu"), FACTOR) is None
    search = device_search(1e6, 2, 2, torch.device("cpu"), FACTOR)
    assert search is not None and search.memory_limit_bytes == 5e5  # shared by the rank's 2 chunks
    assert search.mesh.link == CPU.network.intra and search.mesh.flops_per_s == CPU.flops


def test_limits_from_roomy_to_tight_go_from_whole_to_megatrons_layout() -> None:
    [g] = _graphs(gpt2())
    [full] = tp_layouts([g], 2)
    whole, split = _state(g, {}), _state(g, full.params)
    [roomy] = searched_layouts([g], 2, {}, _search(whole))
    assert roomy.params == {} and len(roomy.search["whole"]) == 9  # small ops: all-reduces cost more than they save
    assert dict(roomy.replicated)["transformer.h.0.mlp.c_fc"] == KEPT_WHOLE
    [tight] = searched_layouts([g], 2, {}, _search(split))
    assert tight.params == full.params and tight.search["whole"] == []


@pytest.mark.parametrize("share", [0.2, 0.5, 0.8])
def test_a_limit_in_between_splits_the_ilps_choice_and_fits(share: float) -> None:
    [g] = _graphs(gpt2())
    [full] = tp_layouts([g], 2)
    whole, split = _state(g, {}), _state(g, full.params)
    limit = split + share * (whole - split)
    search = _search(limit)
    [layout] = searched_layouts([g], 2, {}, search)
    chosen = set(layout.search["split"])
    assert 0 < len(chosen) < 9
    assert {module_of(t) for t in layout.params} <= chosen | {m.removeprefix("net.") for m in chosen}
    assert _state(g, layout.params) <= limit  # the parameters it really split, priced as the runtime holds them
    assert layout.search["state_bytes"] == pytest.approx(_state(g, layout.params))
    ops, fixed = tp_ops(g, full)
    best = brute_force(tp_graph(ops, search), limit - fixed * FACTOR)
    assert layout.search["seconds"] == pytest.approx(best.total_s, rel=1e-9)
    assert not any("wpe" in t for t in layout.params)  # an embedding the full layout keeps whole stays whole


def test_a_tp_plan_entry_is_a_pin() -> None:
    [g] = _graphs(gpt2())
    [full] = tp_layouts([g], 2)
    [layout] = searched_layouts([g], 2, {"*.h.1.mlp.c_fc": "colwise"}, _search(_state(g, {})))
    assert layout.search["split"] == ["transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"]
    assert {t for t in layout.params} == {t for t in full.params if ".h.1.mlp." in t}


def test_the_choice_is_replayed_from_the_plan_and_printed() -> None:
    [g] = _graphs(gpt2())
    [full] = tp_layouts([g], 2)
    [layout] = searched_layouts([g], 2, {}, _search(_state(g, full.params) * 1.3))
    data = layout.data(g)
    [again] = planned_layouts(_graphs(gpt2()), 2, {}, [data["search"]])  # the eval pipeline: no new search
    assert again.params == layout.params and again.search == layout.search
    plan = Plan(layer_names=("all",), layers_per_stage=(1,), num_microbatches=1, schedule="1f1b", world_size=2,
                capture_method="torch.export", tp=2, tp_layouts=(data,))
    assert Plan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert f"tp search: {len(layout.search['split'])} of 10 operations split" in text
    assert "kept whole by the tp search" in text
    shards = sum(p.startswith("Shard") for p in data["activations"].values())
    assert shards > 0 and f"stage 0 activations: {shards} split (Shard)" in text
    assert json.loads(plan.to_json())["tp_layouts"][0]["search"]["split"] == layout.search["split"]


def test_the_planner_completes_the_plan_and_the_runtime_applies_it() -> None:
    # The story: the runtime ran the tp search inside build_pipeline and named the tied parameters
    # itself, so the Plan it was given was not the whole layout. Now the planner completes the plan
    # (`complete_plan`) and the runtime only makes each stage's layout from it (`stage_layouts`).
    from plait.capture.split import split, stage_of_layers
    from plait.capture.trace import capture_batch
    from plait.planner.resolve import complete_plan
    from plait.runtime.tp.layouts import stage_layouts
    from tests.capture.test_tp_layout import VOCAB

    net = gpt2()
    captured = capture_batch(net, {"input_ids": torch.randint(0, VOCAB, (2, 8))})
    names = tuple(captured.layers.layer_names)
    plan = Plan(layer_names=names, layers_per_stage=(2, len(names) - 2), num_microbatches=1, schedule="1f1b",
                world_size=4, capture_method=captured.method, tp=2)
    whole = complete_plan(plan, captured)  # no memory limit: everything that splits does
    assert whole.tied_parameters == (("transformer.wte.weight", (0, 1)),)  # the embedding and the LM head
    assert len(whole.tp_layouts) == 2 and not any(lay.get("search") for lay in whole.tp_layouts)
    limit = 0.8 * sum(FACTOR * p.numel() * p.element_size() for p in net.parameters())
    searched = complete_plan(plan, captured, limit, torch.device("cpu"), FACTOR)
    chosen = [lay.get("search", {}) for lay in searched.tp_layouts]
    assert any(c.get("whole") for c in chosen), chosen  # the ILP kept something whole under the limit
    stages = split(captured, stage_of_layers(plan.layers_per_stage))
    applied = stage_layouts(stages, searched)  # what the runtime lays out: the planner's choice, as it is
    for s, st in enumerate(stages):
        assert applied[s].data(st.module) == searched.tp_layouts[s]
    assert stage_layouts(stages, whole)[1].params != applied[1].params or \
        stage_layouts(stages, whole)[0].params != applied[0].params  # the choice changed what is cut
