"""Hugging Face architectures from tiny random configs (no downloads), with data and a loss each.

`make(name)` builds one: the model (dropout off, so one process and a pipeline draw nothing
random), a batch (a tensor, or a dict of keyword inputs), targets and the loss on the model's
output. Every family plait promises to split is here: decoder-only language models, encoders
(masked language models), an encoder-decoder, a vision transformer and a mixture of experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, ROWS = 64, 8, 16
IMAGE = 8  # ViT: (B, 3, 8, 8) images in 4x4 patches

__all__ = ["Arch", "ARCHITECTURES", "MODEL_CLASSES", "make", "VOCAB", "SEQ", "ROWS"]


@dataclass
class Arch:
    """One architecture's model, inputs, targets and loss."""

    net: nn.Module
    x: Any  # a tensor (positional) or a dict (keyword inputs)
    y: torch.Tensor
    loss: Callable[[Any, torch.Tensor], torch.Tensor]


def token_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a language model's `.logits` (B, T, V) against tokens (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def class_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a classifier's `.logits` (B, C) against labels (B,)."""
    return F.cross_entropy(out.logits, y)


def _padding_mask(g: torch.Generator) -> torch.Tensor:
    """Right padding: 1 on the first 3..SEQ tokens of each row, then 0."""
    lengths = torch.randint(3, SEQ + 1, (ROWS,), generator=g)
    return (torch.arange(SEQ)[None, :] < lengths[:, None]).long()  # (B, T)


_SMALL = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_DECODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=16, attention_dropout=0.0, **_SMALL)
_ENCODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                **_SMALL)


def _configs(t: Any) -> dict[str, Callable[[], Any]]:
    """name -> a function making its config (`t` is the transformers module)."""
    return {
        "gpt2": lambda: t.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, **_SMALL),
        "gpt_neo": lambda: t.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=2, max_position_embeddings=16,
                                          attention_types=[[["global", "local"], 1]], window_size=4,
                                          embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0, **_SMALL),
        "opt": lambda: t.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, ffn_dim=64,
                                   max_position_embeddings=16, word_embed_proj_dim=32, dropout=0.0,
                                   attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, **_SMALL),
        "llama": lambda: t.LlamaConfig(tie_word_embeddings=True, **_DECODER),
        "mistral": lambda: t.MistralConfig(sliding_window=4, **_DECODER),
        "qwen2": lambda: t.Qwen2Config(**_DECODER),
        "gemma": lambda: t.GemmaConfig(head_dim=8, **_DECODER),
        "phi": lambda: t.PhiConfig(resid_pdrop=0.0, embd_pdrop=0.0, **_DECODER),
        "mixtral": lambda: t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                                           **_DECODER),
        "bert": lambda: t.BertConfig(**_ENCODER),
        "roberta": lambda: t.RobertaConfig(**{**_ENCODER, "pad_token_id": 1, "max_position_embeddings": 20}),
        "distilbert": lambda: t.DistilBertConfig(n_layers=2, dim=32, n_heads=2, hidden_dim=64, dropout=0.0,
                                                 attention_dropout=0.0, max_position_embeddings=16,
                                                 vocab_size=VOCAB, pad_token_id=0),
        "albert": lambda: t.AlbertConfig(**{**_ENCODER, "num_hidden_layers": 3}, embedding_size=16),
        "t5": lambda: t.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, d_ff=64, num_heads=4,
                                 dropout_rate=0.0, relative_attention_num_buckets=8,
                                 decoder_start_token_id=0, **_SMALL),
        "bart": lambda: t.BartConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, decoder_start_token_id=0, forced_eos_token_id=None,
                                     **_SMALL),
        "vit": lambda: t.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, num_labels=5,
                                   **{k: v for k, v in _ENCODER.items()
                                      if k not in _SMALL and k != "max_position_embeddings"}),
    }


# The model class of each family: causal LMs, masked LMs, seq2seq LMs, an image classifier.
_CAUSAL = {"gpt2": "GPT2LMHeadModel", "gpt_neo": "GPTNeoForCausalLM", "opt": "OPTForCausalLM",
           "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "gemma": "GemmaForCausalLM", "phi": "PhiForCausalLM", "mixtral": "MixtralForCausalLM"}
_MASKED = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "distilbert": "DistilBertForMaskedLM",
           "albert": "AlbertForMaskedLM"}
_SEQ2SEQ = {"t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration"}
ARCHITECTURES = [*_CAUSAL, *_MASKED, *_SEQ2SEQ, "vit"]
MODEL_CLASSES = (*_CAUSAL.values(), *_MASKED.values(), *_SEQ2SEQ.values(), "ViTForImageClassification")


def make(name: str) -> Arch:
    """A tiny random-init `name` with ROWS rows of fixed data; no downloads."""
    import transformers

    torch.manual_seed(0)
    config = _configs(transformers)[name]()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)  # (B, T), no pad/bos ids
    if name == "vit":
        net = transformers.ViTForImageClassification(config)
        x = torch.randn(ROWS, 3, IMAGE, IMAGE, generator=g)  # (B, C, H, W)
        return Arch(net, {"pixel_values": x}, torch.randint(0, 5, (ROWS,), generator=g), class_loss)
    mask = _padding_mask(g)
    if name in _CAUSAL:
        net = getattr(transformers, _CAUSAL[name])(config)
        return Arch(net, {"input_ids": tokens, "attention_mask": mask}, torch.roll(tokens, -1, dims=1),
                    token_loss)
    if name in _MASKED:
        net = getattr(transformers, _MASKED[name])(config)
        return Arch(net, {"input_ids": tokens, "attention_mask": mask}, tokens, token_loss)
    net = getattr(transformers, _SEQ2SEQ[name])(config)
    decoder = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)  # (B, T)
    x = {"input_ids": tokens, "attention_mask": mask, "decoder_input_ids": decoder}
    return Arch(net, x, torch.roll(decoder, -1, dims=1), token_loss)
