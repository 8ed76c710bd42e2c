"""Hugging Face architectures from tiny random configs (no downloads), with data and a loss each.

`make(name)` builds one: the model (dropout off, so one process and a pipeline draw nothing
random), a batch (a tensor, or a dict of keyword inputs), targets and the loss on the model's
output, the loss a user of that model would write (a mean of per-sample terms). Every family
plait promises to split is here: decoder-only language models (multi-query, soft-capped and
alternating local/global attention among them), encoders (masked language models, disentangled
relative attention), encoder-decoders (text, and speech with a convolutional front end), an
audio encoder on raw waveforms with per-frame targets, vision transformers (plain and
shifted-window), a convolutional vision model, a dual-tower text-image model, a state-space
model, and mixtures of experts (one with a shared expert).
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
    logits: Callable[[Any], torch.Tensor] = lambda out: out.logits  # what `predict` is compared on


def token_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a language model's `.logits` (B, T, V) against tokens (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def class_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a classifier's `.logits` (B, C) against labels (B,)."""
    return F.cross_entropy(out.logits, y)


def frame_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of per-frame logits (B, F, C) against per-frame labels (B, F)."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def pair_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """A dual tower's per-pair loss: 1 - cos(image, text) for a matching pair (y = 1), the
    cosine's positive part for another (y = 0) (torch's CosineEmbeddingLoss, margin 0)."""
    cos = F.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)  # (B,)
    return torch.where(y > 0, 1 - cos, cos.clamp(min=0)).mean()


def both_towers(out: Any) -> torch.Tensor:
    return torch.cat([out.image_embeds, out.text_embeds], dim=-1)  # (B, 2 x projection)


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
        "llama_mha": lambda: t.LlamaConfig(tie_word_embeddings=True, **{**_DECODER, "num_key_value_heads": 4}),
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
        "gpt_bigcode": lambda: t.GPTBigCodeConfig(n_layer=2, n_embd=32, n_head=4, n_positions=16, multi_query=True,
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_SMALL),
        "gemma2": lambda: t.Gemma2Config(head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0, query_pre_attn_scalar=8, **_DECODER),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32, decoder_sparse_step=1,
                                              **_DECODER),
        "mamba": lambda: t.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2,
                                       expand=2, conv_kernel=4, time_step_rank=4, use_cache=False,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0),
        "deberta_v2": lambda: t.DebertaV2Config(**_ENCODER, relative_attention=True, position_buckets=4,
                                                pos_att_type=["p2c", "c2p"], max_relative_positions=8),
        "whisper": lambda: t.WhisperConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                           encoder_attention_heads=2, decoder_attention_heads=2,
                                           encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MELS,
                                           max_source_positions=FRAMES // 2, max_target_positions=16,
                                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                           encoder_layerdrop=0.0, decoder_layerdrop=0.0, use_cache=False,
                                           decoder_start_token_id=0, pad_token_id=0, bos_token_id=0,
                                           eos_token_id=0, suppress_tokens=None, begin_suppress_tokens=None),
        "wav2vec2": lambda: t.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                             conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                             num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                                             layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0,
                                             activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                                             num_labels=5, vocab_size=VOCAB),
        "clip": lambda: t.CLIPConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=16, attention_dropout=0.0),
            vision_config=dict(image_size=IMAGE, patch_size=4, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64, attention_dropout=0.0),
            projection_dim=16),
        "swin": lambda: t.SwinConfig(image_size=IMAGE, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                     window_size=2, num_labels=5, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0),
        "convnext": lambda: t.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[2, 2], patch_size=2, image_size=IMAGE,
                                             num_labels=5, drop_path_rate=0.0),
        "vit": lambda: t.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, num_labels=5,
                                   **{k: v for k, v in _ENCODER.items()
                                      if k not in _SMALL and k != "max_position_embeddings"}),
    }


# The model class of each family: causal LMs, masked LMs, seq2seq LMs, image classifiers, speech.
_CAUSAL = {"gpt2": "GPT2LMHeadModel", "gpt_neo": "GPTNeoForCausalLM", "opt": "OPTForCausalLM",
           "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "gemma": "GemmaForCausalLM", "phi": "PhiForCausalLM", "mixtral": "MixtralForCausalLM",
           "gpt_bigcode": "GPTBigCodeForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "qwen2_moe": "Qwen2MoeForCausalLM", "mamba": "MambaForCausalLM"}
_MASKED = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "distilbert": "DistilBertForMaskedLM",
           "albert": "AlbertForMaskedLM", "deberta_v2": "DebertaV2ForMaskedLM"}
_SEQ2SEQ = {"t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration"}
_IMAGE = {"vit": "ViTForImageClassification", "swin": "SwinForImageClassification",
          "convnext": "ConvNextForImageClassification"}
_OTHER = {"whisper": "WhisperForConditionalGeneration", "wav2vec2": "Wav2Vec2ForAudioFrameClassification",
          "clip": "CLIPModel"}
ARCHITECTURES = [*_CAUSAL, *_MASKED, *_SEQ2SEQ, *_IMAGE, *_OTHER]
_VARIANTS = {"llama_mha": "llama"}  # made as the architecture named, with another config (not in ARCHITECTURES)
MODEL_CLASSES = (*_CAUSAL.values(), *_MASKED.values(), *_SEQ2SEQ.values(), *_IMAGE.values(), *_OTHER.values())
MELS, FRAMES = 8, 16  # Whisper: (B, 8 mel bins, 16 frames), halved by its convolutional front end
SAMPLES = 400  # wav2vec2: raw waveform samples a row; its feature extractor makes 39 frames of them


def make(name: str) -> Arch:
    """A tiny random-init `name` with ROWS rows of fixed data; no downloads."""
    import transformers

    torch.manual_seed(0)
    config = _configs(transformers)[name]()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)  # (B, T), no pad/bos ids
    if name in _IMAGE:
        net = getattr(transformers, _IMAGE[name])(config)
        x = torch.randn(ROWS, 3, IMAGE, IMAGE, generator=g)  # (B, C, H, W)
        return Arch(net, {"pixel_values": x}, torch.randint(0, 5, (ROWS,), generator=g), class_loss)
    if name in _OTHER:
        return _other(name, getattr(transformers, _OTHER[name])(config), tokens, g)
    mask = _padding_mask(g)
    if _VARIANTS.get(name, name) in _CAUSAL:
        net = getattr(transformers, _CAUSAL[_VARIANTS.get(name, name)])(config)
        return Arch(net, {"input_ids": tokens, "attention_mask": mask}, torch.roll(tokens, -1, dims=1),
                    token_loss)
    if name in _MASKED:
        net = getattr(transformers, _MASKED[name])(config)
        return Arch(net, {"input_ids": tokens, "attention_mask": mask}, tokens, token_loss)
    net = getattr(transformers, _SEQ2SEQ[name])(config)
    decoder = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)  # (B, T)
    x = {"input_ids": tokens, "attention_mask": mask, "decoder_input_ids": decoder}
    return Arch(net, x, torch.roll(decoder, -1, dims=1), token_loss)


def _other(name: str, net: nn.Module, tokens: torch.Tensor, g: torch.Generator) -> Arch:
    """Speech in, text out (Whisper); waveform in, a label per frame out (wav2vec2); text and
    images in, two embeddings out (CLIP)."""
    if name == "whisper":
        features = torch.randn(ROWS, MELS, FRAMES, generator=g)  # (B, mel bins, frames)
        decoder = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)  # (B, T)
        return Arch(net, {"input_features": features, "decoder_input_ids": decoder},
                    torch.roll(decoder, -1, dims=1), token_loss)
    if name == "wav2vec2":
        wave = torch.randn(ROWS, SAMPLES, generator=g)  # (B, samples)
        with torch.no_grad():
            frames = net(wave[:1]).logits.shape[1]
        return Arch(net, {"input_values": wave}, torch.randint(0, 5, (ROWS, frames), generator=g), frame_loss)
    images = torch.randn(ROWS, 3, IMAGE, IMAGE, generator=g)  # (B, C, H, W)
    matching = torch.randint(0, 2, (ROWS,), generator=g)  # (B,): 1 where image and text belong together
    return Arch(net, {"input_ids": tokens, "pixel_values": images}, matching, pair_loss, both_towers)
