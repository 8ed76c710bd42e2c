"""Tests for plait.runtime.update.grad_norm: Config(clip_grad_norm=...) equals torch's clip_grad_norm_ in one process.

Each element of the model's gradient is counted once over the ranks: a tied embedding/LM head on
two stages, replicas (and ZeRO-2's shards of them), and tp groups (split parameters by parts,
replicated ones once). fp32 tolerances: the norm to 1e-5 relative (plait adds squares in float64,
torch takes fp32 norms of norms), the parameters after the clipped steps to 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch

import plait
from plait.callbacks import Callback
from tests.architectures import make
from tests.harness import run_ranks

STEPS, MAX_NORM = 3, 0.05  # small enough that every step clips


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def clipped(rank, world, config):
    arch = make("gpt2")
    ref = copy.deepcopy(arch.net)
    model = plait.Model(arch.net, config, optimizer=sgd, loss=arch.loss)
    norms = []
    for _ in range(STEPS):
        model.train_on_batch(arch.x, arch.y)
        norms.append(model.grad_norm)
    state = model.state_dict()
    opt, want = sgd(ref.parameters()), []
    for _ in range(STEPS):
        arch.loss(ref(**arch.x), arch.y).backward()
        want.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    diff = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items() if v.is_floating_point())
    return {"norms": norms, "want": want, "diff": diff}


LAYOUTS = {
    "2 stages, a weight tied across them": (2, dict(num_stages=2, num_microbatches=2)),
    "2 stages x 2 replicas, ZeRO-2": (4, dict(num_stages=2, dp=2, num_microbatches=2, zero=2)),
    "tp=2": (2, dict(tp=2, num_stages=1, num_microbatches=1)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_global_norm_and_the_clipped_steps_equal_one_process(layout):
    world, fields = LAYOUTS[layout]
    results = run_ranks(world, clipped, plait.Config(clip_grad_norm=MAX_NORM, **fields), timeout=280)
    for r in results:
        assert all(n > MAX_NORM for n in r["want"])  # every step clipped: the test can see a wrong norm
        assert r["norms"] == pytest.approx(r["want"], rel=1e-5), r
        assert r["diff"] <= 1e-6, r
    assert len({tuple(r["norms"]) for r in results}) == 1  # the same norm on every rank


def test_without_clipping_there_is_no_norm():
    arch = make("gpt2")
    model = plait.Model(arch.net, plait.Config(), optimizer=sgd, loss=arch.loss)
    model.train_on_batch(arch.x, arch.y)
    assert model.grad_norm is None
    with pytest.raises(plait.ConfigError, match="clip_grad_norm must be a positive number"):
        plait.Config(clip_grad_norm=0)


def test_fit_logs_each_steps_norm():
    arch = make("gpt2")
    ref = copy.deepcopy(arch.net)
    model = plait.Model(arch.net, plait.Config(clip_grad_norm=MAX_NORM), optimizer=sgd, loss=arch.loss)
    seen = []

    class Norms(Callback):
        def on_batch_end(self, batch, logs):
            seen.append(logs["grad_norm"])

    model.fit(arch.x, arch.y, epochs=1, batch_size=8, shuffle=False, verbose=0, callbacks=[Norms()])
    assert len(seen) == 2 and seen[-1] == model.grad_norm
    first = make("gpt2")  # the first batch's norm, by hand
    loss = arch.loss(ref(**{k: v[:8] for k, v in first.x.items()}), first.y[:8])
    loss.backward()
    assert seen[0] == pytest.approx(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)), rel=1e-5)
