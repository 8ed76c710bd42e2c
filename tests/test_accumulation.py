"""Gradient accumulation: Config(accumulate_steps=k) sums k global batches' gradients before one step, as one process does.

One process: for each of k batches, (loss(batch) / k).backward(), then one optimizer step. plait
runs one global batch per `train_on_batch` and steps at every k-th. Tolerances as in
tests/test_real_models.py for Hugging Face models (2e-5 on parameters).
"""

from __future__ import annotations

import copy

import pytest
import torch

import plait
from tests.architectures import make
from tests.harness import run_ranks

K, CYCLES = 2, 2


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def batches(arch):
    """K x CYCLES batches of 8 rows: the architecture's 16 rows, each half in turn."""
    halves = [({k: v[:8] for k, v in arch.x.items()}, arch.y[:8]), ({k: v[8:] for k, v in arch.x.items()}, arch.y[8:])]
    return [halves[i % 2] for i in range(K * CYCLES)]


def accumulated(rank, world, config):
    arch = make("gpt2")
    ref = copy.deepcopy(arch.net)
    model = plait.Model(arch.net, config, optimizer=sgd, loss=arch.loss,
                        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    losses = [model.train_on_batch(x, y) for x, y in batches(arch)]
    state = model.state_dict()
    opt = sgd(ref.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    want = []
    for i, (x, y) in enumerate(batches(arch)):
        loss = arch.loss(ref(**x), y)
        want.append(float(loss))
        (loss / K).backward()
        if i % K == K - 1:
            opt.step()
            opt.zero_grad()
            schedule.step()
    diff = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items() if v.is_floating_point())
    return {"losses": losses, "want": want, "diff": diff, "lr": model.optimizer.param_groups[0]["lr"],
            "want_lr": opt.param_groups[0]["lr"]}


LAYOUTS = {
    "2 stages": (2, dict(num_stages=2, num_microbatches=2)),
    "2 stages x 2 replicas, ZeRO-2": (4, dict(num_stages=2, dp=2, num_microbatches=2, zero=2)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_k_batches_summed_before_one_step_equal_one_process(layout):
    world, fields = LAYOUTS[layout]
    for r in run_ranks(world, accumulated, plait.Config(accumulate_steps=K, **fields), timeout=280):
        assert r["losses"] == pytest.approx(r["want"], rel=1e-5), r
        assert r["diff"] <= 2e-5, r
        assert r["lr"] == r["want_lr"] == 0.2 * 0.5**CYCLES, r  # the schedule stepped once per optimizer step


def test_accumulation_refuses_what_would_lose_its_sums():
    with pytest.raises(plait.ConfigError, match="accumulate_steps must be a positive integer"):
        plait.Config(accumulate_steps=0)
    with pytest.raises(plait.ConfigError, match="checkpoint_every=3 is not a multiple of accumulate_steps=2"):
        plait.Config(accumulate_steps=2, checkpoint_every=3)
    with pytest.raises(plait.ConfigError, match="use one of the two"):
        plait.Config(accumulate_steps=2, replan=True)
    arch = make("gpt2")
    model = plait.Model(arch.net, plait.Config(accumulate_steps=2), optimizer=sgd, loss=arch.loss)
    model.train_on_batch(arch.x, arch.y)
    with pytest.raises(plait.CheckpointError, match="inside an accumulation"):
        model.save("unused")
