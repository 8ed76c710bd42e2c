"""Tests for plait.planner.tp_shares: what tp splits in each captured layer of a Hugging Face GPT-2
(the runtime's own layout), and the collectives charged to each layer, per row. One process."""

from __future__ import annotations

import pytest
import torch

from plait.capture.trace import capture_batch
from plait.planner.tp_shares import tp_shares

transformers = pytest.importorskip("transformers")
VOCAB, SEQ, EMBD = 64, 8, 32


def _captured(heads: int = 4):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=EMBD, n_head=heads, vocab_size=VOCAB, n_positions=16,
                                  use_cache=False, bos_token_id=0, eos_token_id=0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return capture_batch(transformers.GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, VOCAB, (2, SEQ))})


def test_gpt2_layers_carry_megatrons_collectives_and_split_weights() -> None:
    captured = _captured()
    shares = tp_shares(captured, 2)
    layer = {name: i for i, name in enumerate(captured.layers.layer_names)}
    hidden_row = SEQ * EMBD * 4  # one row's hidden states, fp32
    for h in ("transformer.h.0", "transformer.h.1"):
        c_attn, c_proj = layer[f"{h}.attn.c_attn"], layer[f"{h}.attn.c_proj"]
        fc, proj = layer[f"{h}.mlp.c_fc"], layer[f"{h}.mlp.c_proj"]
        assert shares.split_bytes[c_attn] == (EMBD * 3 * EMBD + 3 * EMBD) * 4  # weight and bias, q|k|v
        assert shares.split_bytes[fc] == (EMBD * 4 * EMBD + 4 * EMBD) * 4
        assert shares.split_bytes[proj] == 4 * EMBD * EMBD * 4  # its bias stays whole
        for rowwise in (c_proj, proj):  # g: the partial sums all-reduced in the forward
            assert shares.forward_reduce_row_bytes[rowwise] == hidden_row
            assert shares.forward_collectives[rowwise] == 1
        for colwise in (c_attn, fc):  # f: the input's gradient all-reduced in the backward
            assert shares.backward_reduce_row_bytes[colwise] == hidden_row
            assert shares.backward_collectives[colwise] == 1
        assert shares.split_share[layer[f"{h}.mlp.act"]] == 1.0  # the GELU runs on the split hidden
        assert shares.split_share[layer[f"{h}.ln_1"]] == 0.0
    assert shares.forward_collectives[layer["transformer.wte"]] == 1  # the vocab-split lookup's sum
    assert shares.gather_row_bytes[layer["lm_head"]] == SEQ * VOCAB * 4  # the logits, gathered whole
    whole = [i for i, name in enumerate(captured.layers.layer_names) if "ln_" in name or "wpe" in name]
    assert all(shares.split_bytes[i] == 0 for i in whole)


def test_heads_that_do_not_divide_leave_attention_whole() -> None:
    captured = _captured(heads=2)
    shares = tp_shares(captured, 4)
    layer = {name: i for i, name in enumerate(captured.layers.layer_names)}
    assert shares.split_bytes[layer["transformer.h.0.attn.c_attn"]] == 0
    assert shares.split_bytes[layer["transformer.h.0.mlp.c_fc"]] > 0
    assert any("replicated" in line for line in shares.layouts)


def _lm_loss(out, y):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))


def test_a_cross_entropy_on_the_split_logits_is_priced_as_its_all_reduces_not_a_gather() -> None:
    captured = _captured()
    head = captured.layers.layer_names.index("lm_head")
    gathered = tp_shares(captured, 2)
    target = torch.randint(0, VOCAB, (2, SEQ))
    split = tp_shares(captured, 2, loss=_lm_loss, target=target)
    assert split.gather_row_bytes[head] == 0
    # log-softmax's max and sum, nll's picked values forward; the sum's gradient backward: per token, fp32
    assert split.forward_collectives[head] == gathered.forward_collectives[head] - 1 + 3
    assert split.backward_collectives[head] == gathered.backward_collectives[head] + 1
    assert split.forward_reduce_row_bytes[head] == gathered.forward_reduce_row_bytes[head] + 3 * SEQ * 4
    assert split.backward_reduce_row_bytes[head] == gathered.backward_reduce_row_bytes[head] + SEQ * 4
    others = [i for i in range(len(captured.layers.layer_names)) if i != head]
    assert [split.forward_collectives[i] for i in others] == [gathered.forward_collectives[i] for i in others]


def test_a_loss_that_needs_the_whole_logits_keeps_the_gather() -> None:
    captured = _captured()
    head = captured.layers.layer_names.index("lm_head")

    def smoothed(out, y):  # label smoothing: not a plain log-softmax and nll of the split logits
        return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1), label_smoothing=0.1)

    shares = tp_shares(captured, 2, loss=smoothed, target=torch.randint(0, VOCAB, (2, SEQ)))
    assert shares.gather_row_bytes[head] == SEQ * VOCAB * 4


class _GatedMlp(torch.nn.Module):
    """Two column-parallel linears reading one input (Llama's gate and up), then a row-parallel one."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.gate(x)) * self.up(x))


def test_a_model_captured_in_bf16_is_priced_with_its_split_sums_in_fp32_one_for_each_reader() -> None:
    """bf16 (Config(precision="bf16")): the runtime adds the partial sums in fp32 and rounds once,
    each column-parallel reader's input gradient on its own (`plait.runtime.tp.tensor_parallel`)."""
    from plait.capture.compute_dtype import held_in

    net, x = _GatedMlp(), torch.randn(2, SEQ, 8)
    fp32 = tp_shares(capture_batch(net, x), 2)
    with held_in(net, torch.bfloat16):
        bf16 = tp_shares(capture_batch(net, x.bfloat16()), 2)
    row = SEQ * 8 * 4  # a row of the 8 features, in fp32 bytes
    assert sum(fp32.forward_reduce_row_bytes) == sum(bf16.forward_reduce_row_bytes) == row  # the down sum
    assert (sum(fp32.backward_collectives), sum(fp32.backward_reduce_row_bytes)) == (1, row)  # x's, shared
    assert (sum(bf16.backward_collectives), sum(bf16.backward_reduce_row_bytes)) == (2, 2 * row)  # gate's, up's
    assert sum(bf16.split_bytes) == sum(fp32.split_bytes) / 2  # the weights themselves in bf16
