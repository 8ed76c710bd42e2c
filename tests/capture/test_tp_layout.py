"""Tests for plait.capture.megatron_layout, tp_layout, shard_rules and graph_nodes: Megatron's layout found on
captured graphs (Hugging Face GPT-2, Llama with grouped-query attention, BERT), what is left whole and why, and
tp_plan's overrides and errors. Pure: one process, no collectives."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch import nn

from plait.capture.graph_nodes import reshape_dim
from plait.capture.megatron_layout import tp_layouts
from plait.capture.split import split
from plait.capture.tp_layout import TpLayout, module_of
from plait.capture.trace import capture_batch
from plait.errors import ConfigError
from plait.tensor_parts import part_size

transformers = pytest.importorskip("transformers")
VOCAB = 64


def _graphs(net: nn.Module, cuts: tuple[int, ...] = ()) -> list[fx.GraphModule]:
    x = torch.randint(0, VOCAB, (2, 8))
    captured = capture_batch(net, {"input_ids": x})
    n = len(captured.layers.layer_names)
    stage, marks = [], list(cuts)
    s = 0
    for i in range(n):
        if marks and i == marks[0]:
            marks.pop(0)
            s += 1
        stage.append(s)
    return [st.module for st in split(captured, stage)]


def gpt2(heads: int = 4, attn_pdrop: float = 0.0, attention: str = "sdpa") -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=heads, vocab_size=VOCAB, n_positions=16,
                                  use_cache=False, bos_token_id=0, eos_token_id=0, attn_pdrop=attn_pdrop)
    cfg._attn_implementation = attention
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
                                   use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _split_modules(layout: TpLayout) -> dict[str, tuple[int, int]]:
    return {t.removeprefix("net."): v for t, v in layout.params.items()}


def test_gpt2_gets_megatron_layout() -> None:
    [layout] = tp_layouts(_graphs(gpt2()), 2)
    params = _split_modules(layout)
    for i in range(2):
        h = f"transformer.h.{i}"
        assert params[f"{h}.attn.c_attn.weight"] == (1, 3)  # Conv1D (in, out): q|k|v by heads
        assert params[f"{h}.attn.c_attn.bias"] == (0, 3)
        assert params[f"{h}.attn.c_proj.weight"] == (0, 1)  # rowwise: input features
        assert f"{h}.attn.c_proj.bias" not in params  # added once, after the all-reduce
        assert params[f"{h}.mlp.c_fc.weight"] == (1, 1)
        assert params[f"{h}.mlp.c_proj.weight"] == (0, 1)
    assert params["lm_head.weight"] == (0, 1)  # tied with wte: vocab rows for both
    assert sorted(set(layout.roles.values())) == ["colwise", "rowwise", "vocab"]
    assert list(layout.roles.values()).count("rowwise") == 4
    assert layout.replicated == ()


def test_the_layout_as_data_names_placements_and_collectives() -> None:
    [graph] = _graphs(gpt2())
    [layout] = tp_layouts([graph], 2)
    data = layout.data(graph)
    assert data["parameters"]["transformer.h.0.attn.c_attn.weight"] == {"placement": "Shard(1)", "blocks": 3}
    assert data["parameters"]["transformer.h.0.mlp.c_proj.weight"] == {"placement": "Shard(0)", "blocks": 1}
    kinds = [(c["kind"], c["pass"]) for c in data["collectives"]]
    # per block: 2 row-parallel sums (g) and 2 input-gradient sums (f); the vocab lookup; the logits
    assert kinds.count(("all_reduce", "forward")) == 2 * 2 + 1
    assert kinds.count(("all_reduce", "backward")) == 2 * 2 + 1  # the LM head's input too
    assert kinds.count(("all_gather", "forward")) == 1
    at = {c["at"] for c in data["collectives"] if c["pass"] == "forward" and c["kind"] == "all_reduce"}
    assert {"transformer.h.0.attn.c_proj", "transformer.h.1.mlp.c_proj"} <= at
    assert sum("vocabulary rows" in c["why"] for c in data["collectives"]) == 1  # the (tied) embedding
    assert data["replicated"] == {}
    # activations: the fused q|k|v output split in 3 blocks, the MLP's hidden split, each row-parallel
    # product and the vocab lookup a partial sum, the logits split by vocabulary; the rest replicated
    acts = data["activations"]
    nodes = {n.name: n for n in graph.graph.nodes}
    qkv = next(n for n in nodes.values() if layout.roles.get(n.name) == "colwise"
               and "c_attn" in str(n.args[2].target))
    assert acts[qkv.name] == "Shard(1) in 3 blocks"
    assert list(acts.values()).count("Partial() -> Replicate()") == 2 * 2 + 1
    gelu = [name for name, p in acts.items() if "gelu" in name or "tanh" in name]
    assert gelu and all(acts[g] == "Shard(2)" or acts[g] == "Shard(1)" for g in gelu)
    output_args = nodes["output"].all_input_nodes
    assert [acts.get(v.name) for v in output_args].count("Shard(2)") == 1  # the logits
    for n in nodes.values():  # the layer norms' outputs are whole
        if n.target is torch.ops.aten.native_layer_norm.default:
            assert n.name not in acts
    assert json.loads(json.dumps(data)) == data


def test_llama_grouped_query_attention_split_by_heads() -> None:
    [layout] = tp_layouts(_graphs(llama()), 2)
    params = _split_modules(layout)
    attn = "model.layers.0.self_attn"
    assert params[f"{attn}.q_proj.weight"] == (0, 1)
    assert params[f"{attn}.k_proj.weight"] == (0, 1)  # 2 key/value heads: one per rank
    assert params[f"{attn}.o_proj.weight"] == (1, 1)
    assert params["model.layers.0.mlp.down_proj.weight"] == (1, 1)
    assert layout.replicated == ()


def test_heads_that_do_not_divide_stay_replicated_with_the_reason() -> None:
    [layout] = tp_layouts(_graphs(gpt2(heads=2)), 4)  # 2 heads on 4 ranks
    params = _split_modules(layout)
    assert "transformer.h.0.attn.c_attn.weight" not in params
    assert params["transformer.h.0.mlp.c_fc.weight"] == (1, 1)  # the MLP still splits
    names = [name for name, _ in layout.replicated]
    assert "transformer.h.0.attn.c_attn" in names
    assert any("replicated" in line for line in layout.describe())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_with_dropout_splits_by_heads(attention: str) -> None:
    """GPT-2's default attention dropout (0.1), inside scaled_dot_product_attention or eager: split by
    heads, each rank's part of the whole mask kept (`SplitAttention`, `SplitDropout`); it once kept
    every attention block whole ("attention dropout 0.1 inside the fused kernel")."""
    [layout] = tp_layouts(_graphs(gpt2(attn_pdrop=0.1, attention=attention)), 2)
    assert _split_modules(layout)["transformer.h.0.attn.c_attn.weight"] == (1, 3)
    assert _split_modules(layout)["transformer.h.1.attn.c_proj.weight"] == (0, 1)
    assert layout.replicated == ()


@pytest.mark.timeout(60)
def test_gpt2_config_defaults_hold_about_half_the_parameter_bytes_per_rank() -> None:
    """GPT2Config's default dropouts (0.1 on attention, residuals, embeddings) at tp=2, sizes made
    small (a vocabulary that divides by tp): each rank holds <= 0.55 of the parameter bytes (0.64
    while the attention stayed whole)."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=16, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    assert cfg.attn_pdrop == cfg.resid_pdrop == cfg.embd_pdrop == 0.1
    [gm] = _graphs(transformers.GPT2LMHeadModel(cfg))
    [layout] = tp_layouts([gm], 2)
    params = dict(gm.named_parameters())
    held = sum(p.numel() // (2 if name in layout.params else 1) for name, p in params.items())
    assert held <= 0.55 * sum(p.numel() for p in params.values()), held


@pytest.mark.timeout(60)
def test_a_vocabulary_that_does_not_divide_splits_unevenly() -> None:
    """GPT2Config's 50257 words at tp=2 (here 65): the word embedding and the LM head tied to it
    split by rows all the same, the last rank holding one fewer (they once stayed whole, with the
    reason "its 65 rows do not divide by tp=2"); the logits leave the stage split."""
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB + 1, n_positions=16,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    [gm] = _graphs(transformers.GPT2LMHeadModel(cfg))
    [layout] = tp_layouts([gm], 2)
    assert layout.replicated == ()
    [tied] = {"transformer.wte.weight", "lm_head.weight"} & set(_split_modules(layout))  # by its graph name
    assert _split_modules(layout)[tied] == (0, 1)
    assert _split_modules(layout)["transformer.h.0.attn.c_attn.weight"] == (1, 3)
    assert sorted(layout.roles.values()).count("vocab") == 1 and "colwise" in layout.roles.values()
    [logits] = [n for n in gm.graph.nodes if n.op == "output"][0].all_input_nodes[:1]
    assert layout.values[logits.name].dim == 2


@pytest.mark.timeout(120)
def test_gpt2_config_as_it_comes_holds_about_half_the_parameter_bytes_per_rank() -> None:
    """GPT2Config() full size (124M parameters, on the meta device: the layout needs only shapes) at
    tp=2: the rank holding the larger part of the 50257 words holds 0.503 of the parameters (0.658
    while the words stayed whole for not dividing by 2)."""
    cfg = transformers.GPT2Config(use_cache=False)  # (a key/value cache is no training output)
    with torch.device("meta"):
        net = transformers.GPT2LMHeadModel(cfg)
    [gm] = _graphs(net)
    [layout] = tp_layouts([gm], 2)
    assert layout.replicated == () and cfg.vocab_size == 50257
    params = dict(gm.named_parameters())

    def held(rank: int) -> int:
        return sum(p.numel() // p.shape[cut[0]] * part_size(p.shape[cut[0]], rank, 2) if (cut := layout.params.get(n))
                   else p.numel() for n, p in params.items())
    assert held(0) - held(1) == cfg.n_embd  # one word's row more
    assert held(0) <= 0.505 * sum(p.numel() for p in params.values()), held(0)


def test_an_untied_head_over_a_vocabulary_that_does_not_divide_splits_unevenly_too() -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB + 1, n_positions=16,
                                  use_cache=False, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    [layout] = tp_layouts(_graphs(transformers.GPT2LMHeadModel(cfg)), 2)
    assert layout.replicated == ()
    assert _split_modules(layout)["transformer.wte.weight"] == _split_modules(layout)["lm_head.weight"] == (0, 1)


@pytest.mark.timeout(60)
def test_a_vocabulary_that_leaves_the_last_rank_no_rows_stays_whole_with_the_reason() -> None:
    """65 rows at tp=16 cut in parts of 5 leave rank 15 none (5 x 13 = 65): kept whole, and said."""
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=16, vocab_size=VOCAB + 1, n_positions=16,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    [layout] = tp_layouts(_graphs(transformers.GPT2LMHeadModel(cfg)), 16)
    [(name, why)] = layout.replicated  # the tied weight, by its graph name
    assert name in ("transformer.wte", "lm_head")
    assert why == f"its {VOCAB + 1} rows cut in parts of 5 leave rank 15 none at tp=16"
    assert not {"transformer.wte.weight", "lm_head.weight"} & set(_split_modules(layout))


def test_bert_masked_lm_head_splits_the_decoder_not_the_transform() -> None:
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16)
    [layout] = tp_layouts(_graphs(transformers.BertForMaskedLM(cfg)), 2)
    params = _split_modules(layout)
    assert params["cls.predictions.decoder.weight"] == (0, 1)
    assert params["cls.predictions.decoder.bias"] == (0, 1)
    assert dict(layout.replicated)["cls.predictions.transform.dense"] == "layer norm over the split dimension"


def test_tied_weight_on_two_stages_is_cut_alike() -> None:
    graphs = _graphs(gpt2(), cuts=(12,))
    first, last = tp_layouts(graphs, 2)
    assert _split_modules(first).get("lm_head.weight") == _split_modules(last).get("lm_head.weight") == (0, 1)


def test_tp_plan_overrides_and_errors() -> None:
    graphs = _graphs(gpt2())
    [layout] = tp_layouts(graphs, 2, {"*.mlp.c_fc": "replicate"})
    params = _split_modules(layout)
    assert "transformer.h.0.mlp.c_fc.weight" not in params
    assert "transformer.h.0.mlp.c_proj.weight" not in params  # no split input reaches it: whole
    assert params["transformer.h.0.attn.c_attn.weight"] == (1, 3)
    with pytest.raises(ConfigError, match=r"\*\.nothing.*match no linear"):
        tp_layouts(graphs, 2, {"*.nothing": "colwise"})
    with pytest.raises(ConfigError, match="ln_f.*cannot run split|do not divide"):
        tp_layouts(graphs, 3, {"*.mlp.c_fc": "colwise"})  # 128 features do not divide by 3
    with pytest.raises(ConfigError, match="strategy is one of"):
        tp_layouts(graphs, 2, {"*.mlp.c_fc": "diagonal"})
    # a layout given explicitly, as the weight's placement (Conv1D's weight is in x out)
    assert tp_layouts(graphs, 2, {"*.mlp.c_fc": "Shard(1)", "*.mlp.c_proj": "Shard(0)"})[0].params == \
        tp_layouts(graphs, 2)[0].params
    assert tp_layouts(graphs, 2, {"*.mlp.c_fc": "Replicate()"})[0].params == layout.params
    with pytest.raises(ConfigError, match=r"h\.0\.mlp\.c_fc 'Shard\(2\)'.*dim 1 \(colwise\) or 0 \(rowwise\)"):
        tp_layouts(graphs, 2, {"*.mlp.c_fc": "Shard(2)"})


def test_forced_colwise_that_cannot_split_names_the_module() -> None:
    with pytest.raises(ConfigError, match="lm_head|c_proj"):
        tp_layouts(_graphs(gpt2()), 2, {"*.mlp.c_proj": "colwise"})  # its output meets the residual add


def test_module_of() -> None:
    assert module_of("net.transformer.h.0.mlp.c_fc.weight") == "transformer.h.0.mlp.c_fc"


@pytest.mark.parametrize("before, after, dim, parts, want", [
    ((2, 8, 96), (16, 96), 2, 2, 1),            # rows merged before: the features stay
    ((2, 8, 32), (2, 8, 4, 8), 2, 2, 2),        # features -> heads x head_dim: heads split
    ((2, 4, 8, 8), (2, 4, 64), 1, 2, 1),        # heads keep their place, the rest merged
    ((2, 4, 8, 8), (8, 8, 8), 1, 2, None),      # heads merged into the rows: not one dimension's split
    ((2, 8, 4, 8), (2, 8, 32), 2, 2, 2),        # heads x head_dim -> features
    ((2, 8, 6), (2, 8, 3, 2), 2, 2, None),      # 3 pieces do not divide by 2
])
def test_reshape_dim(before: tuple[int, ...], after: tuple[int, ...], dim: int, parts: int, want: int | None) -> None:
    assert reshape_dim(before, after, dim, parts, 1) == want


# -- sequence parallelism --------------------------------------------------------------------------

@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_sequence_parallel_splits_the_tokens_between_the_blocks(build) -> None:
    from plait.capture.shard_rules import Shard
    graph = _graphs(build())
    [plain] = tp_layouts(graph, 2)
    [layout] = tp_layouts(graph, 2, sequence_parallel=True)
    assert layout.params == plain.params and layout.roles == plain.roles  # the same weights split
    rowwise = [n for n, r in layout.roles.items() if r == "rowwise"]
    assert sorted(layout.seq_entries) == sorted(rowwise)  # every row-parallel sum reduce-scattered
    nodes = {n.name: n for n in graph[0].graph.nodes}
    for value, dim in layout.seq_entries.values():
        assert len(nodes[value].meta["val"].shape) == 3 and dim == 1  # (batch, sequence, features): the sequence
    seq = {name for name, lay in layout.values.items() if isinstance(lay, Shard) and lay.seq}
    norms = [n for n in nodes.values() if "norm" in str(n.target) or n.target is torch.ops.aten.rsqrt.default]
    assert sum(n.name in seq for n in norms) >= 2  # the norms after the first block's halves run on split tokens
    # whatever reads the tokens whole gets them gathered: the column-parallel inputs, the LM head
    for name in layout.gathers:
        assert any(isinstance(layout.values.get(a.name), Shard) and layout.values[a.name].seq
                   for a in nodes[name].all_input_nodes)
    data = layout.data(graph[0])
    kinds = [(c["kind"], c["pass"]) for c in data["collectives"]]
    assert kinds.count(("reduce_scatter", "forward")) == len(rowwise)
    assert kinds.count(("all_gather", "forward")) >= len(layout.gathers)
    assert ("all_reduce", "forward") in kinds  # the vocab lookup's sum; no row-parallel all-reduce left
    assert sum(c["kind"] == "all_reduce" and c["pass"] == "forward" for c in data["collectives"]) == 1
    assert any(p.endswith("tokens") for p in data["activations"].values())


def test_sequence_parallel_leaves_a_sequence_that_does_not_divide_to_all_reduce() -> None:
    net = gpt2()
    captured = capture_batch(net, {"input_ids": torch.randint(0, VOCAB, (2, 7))})
    [stage] = split(captured, [0] * len(captured.layers.layer_names))
    [layout] = tp_layouts([stage.module], 2, sequence_parallel=True)
    assert layout.seq_entries == {} and layout.gathers == frozenset()
    assert any(r == "rowwise" for r in layout.roles.values())


def test_a_stage_cut_inside_a_block_keeps_the_rest_of_the_block_whole() -> None:
    # Llama cut after the MLP's activation: gate_proj splits on the first stage (its output is
    # gathered as it leaves), and on the second the whole received value meets up_proj's output:
    # up_proj and down_proj stay whole there (the received value's traced shape is known)
    names = capture_batch(llama(), {"input_ids": torch.randint(0, VOCAB, (2, 8))}).layers.layer_names
    graphs = _graphs(llama(), (names.index("model.layers.0.mlp.up_proj"),))
    first, second = tp_layouts(graphs, 2)
    assert "net.model.layers.0.mlp.gate_proj.weight" in first.params
    assert dict(second.replicated).keys() >= {"model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}
    placeholders = [n for n in graphs[1].graph.nodes if n.op == "placeholder"]
    assert all("val" in n.meta for n in placeholders)
