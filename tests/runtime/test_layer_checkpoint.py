"""Recomputation layer by layer (plait.runtime.layer_checkpoint): a Hugging Face GPT-2 with dropout
trains bit for bit as without recomputation, keeps less than recomputing its stage whole, and its
stage graph is cut into one piece per transformer block."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._pytree import tree_flatten

import plait
from plait.capture.split import split
from plait.capture.trace import capture_batch
from plait.cost.recompute_pieces import pieces
from plait.errors import ConfigError
from plait.runtime.layer_checkpoint import layer_checkpointed
from benchmarks.live_bytes import LiveBytes

LAYERS = 6


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)  # dropouts 0.1
    return transformers.GPT2LMHeadModel(config)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(1))
    return x, torch.roll(x, -1, dims=1)


def loss(out, y: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def train(**config: object) -> tuple[dict[str, torch.Tensor], int, plait.Model]:
    """Two GPipe steps of 4 micro-batches on one process; the second step's peak live bytes."""
    x, y = tokens()
    model = plait.Model(gpt2(), plait.Config(num_microbatches=4, schedule="gpipe", **config),  # type: ignore[arg-type]
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=loss)
    torch.manual_seed(5)
    model.train_on_batch(x, y)
    with LiveBytes() as live:
        model.train_on_batch(x, y)
    return model.state_dict(), live.peak, model


@pytest.mark.timeout(300)
def test_recomputed_layer_by_layer_it_trains_the_same_and_keeps_least() -> None:
    kept, kept_peak, _ = train(recompute=False)
    whole, whole_peak, _ = train(recompute=True)
    layered, layered_peak, model = train(recompute=True, recompute_by_layer=True)
    assert (model.plan.recompute, model.plan.recompute_by_layer) == ((0,), (0,))
    assert "recomputed layer by layer" in str(model.plan)
    for name, value in kept.items():  # the same dropout masks drawn again: bit for bit
        assert torch.equal(whole[name], value), name
        assert torch.equal(layered[name], value), name
    # GPipe holds 4 micro-batches: whole, their inputs and one micro-batch's 6 blocks while it
    # is recomputed; layer by layer, each block's input of 4 and one block's activations
    assert layered_peak < 0.75 * whole_peak < 0.75 * kept_peak, (layered_peak, whole_peak, kept_peak)


def test_the_stage_graph_is_cut_into_one_piece_per_block() -> None:
    net = gpt2()
    captured = capture_batch(net, tokens()[0], train=True)
    names = captured.layers.layer_names
    stage = split(captured, [0] * len(names))[0]
    layered = layer_checkpointed(stage.module, pieces(names))
    checkpointed = [name for name, _ in layered.named_children() if name.startswith("submod_")]
    # wte, wpe, the embedding dropout, the 6 blocks, ln_f and lm_head
    assert len(set(pieces(names))) == len(checkpointed) == 5 + LAYERS
    x = tokens()[0]
    torch.manual_seed(3)
    want = stage.module(x)
    torch.manual_seed(3)
    got = layered(x)
    assert torch.equal(tree_flatten(got)[0][0], tree_flatten(want)[0][0])


def test_recompute_by_layer_names_what_it_accepts() -> None:
    with pytest.raises(ConfigError, match="recompute_by_layer='all' is not known; use True, False or a list"):
        plait.Config(recompute_by_layer="all")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"recompute_by_layer=\[-1\] must list stage indices >= 0"):
        plait.Config(recompute_by_layer=[-1])  # type: ignore[arg-type]
    assert plait.Config(recompute_by_layer=[1, 0]).recompute_by_layer == (1, 0)
    x, y = tokens()
    model = plait.Model(gpt2(), plait.Config(num_microbatches=2, recompute=False, recompute_by_layer=[0]),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=loss)
    with pytest.raises(ConfigError, match=r"names stages \[0\] that do not recompute"):
        model.train_on_batch(x, y)
