"""The planner chooses recomputation layer by layer where memory demands it, and that layout trains as
one process does: a Hugging Face GPT-2 on 2 ranks under a memory limit its stages meet, recomputed
layer by layer, with 16 micro-batches; told to recompute whole (Config(recompute_by_layer=False)),
the planner needs more, smaller micro-batches for the same limit."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import plait
from tests.harness import run_ranks

LIMIT = 4 * 2**20  # bytes per rank for the GPT-2 below: recomputation needed
STEPS = 2


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def loss(out, y: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def sgd(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1)


def train(rank: int, world: int) -> dict:
    x = torch.randint(0, 128, (32, 64), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    out = {}
    for name, by_layer in (("planned", None), ("whole", False)):
        net = gpt2()
        ref = copy.deepcopy(net)
        model = plait.Model(net, plait.Config(memory_limit_bytes=LIMIT, recompute_by_layer=by_layer),
                            optimizer=sgd, loss=loss)
        losses = [model.train_on_batch(x, y) for _ in range(STEPS)]
        opt, want = sgd(ref.parameters()), []
        for _ in range(STEPS):
            opt.zero_grad()
            value = loss(ref(x), y)
            value.backward()
            opt.step()
            want.append(value.item())
        state = model.state_dict()
        out[name] = {"recompute": model.plan.recompute, "by_layer": model.plan.recompute_by_layer,
                     "layout": (model.plan.num_stages, model.plan.dp, model.plan.num_microbatches, model.plan.schedule),
                     "losses": losses, "want": want,
                     "diff": max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items())}
    return out


@pytest.mark.timeout(240)
def test_the_planner_recomputes_layer_by_layer_where_memory_demands_it():
    for result in run_ranks(2, train, timeout=230):
        planned, whole = result["planned"], result["whole"]
        assert planned["recompute"] and planned["by_layer"] == planned["recompute"], planned
        assert whole["by_layer"] == (), whole  # told not to: every recomputed stage whole
        # recomputed whole, the stages fit only with micro-batches half as large (twice as many)
        assert whole["recompute"] and whole["layout"][2] > planned["layout"][2], (planned, whole)
        for run in (planned, whole):
            assert run["losses"] == pytest.approx(run["want"], rel=1e-5, abs=1e-6)
            assert run["diff"] < 1e-5
