"""Learning-rate schedules: Model(lr_scheduler=...) steps one on every rank per optimizer step, as one process does, and checkpoints carry it."""

from __future__ import annotations

import copy

import pytest
import torch

import plait
from tests.architectures import make
from tests.harness import run_ranks


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def one_process(net, arch, steps):
    """Plain PyTorch: the same optimizer and schedule, one step of each per batch."""
    opt = sgd(net.parameters())
    schedule = halving(opt)
    for _ in range(steps):
        arch.loss(net(**arch.x), arch.y).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return net, opt.param_groups[0]["lr"]


def scheduled(rank, world, root):
    arch = make("gpt2")
    whole = copy.deepcopy(arch.net)
    first = plait.Model(copy.deepcopy(arch.net), plait.Config(num_stages=2, num_microbatches=2), optimizer=sgd,
                        loss=arch.loss, lr_scheduler=halving)
    for _ in range(2):
        first.train_on_batch(arch.x, arch.y)
    lrs = [first.optimizer.param_groups[0]["lr"]]
    first.save(root)
    # another layout (2 replicas of one stage) resumes the checkpoint: the schedule goes on from step 2
    again = plait.Model(copy.deepcopy(arch.net), plait.Config(num_stages=1, dp=2), optimizer=sgd, loss=arch.loss,
                        lr_scheduler=halving)
    again.build(arch.x)
    again.load(root)
    lrs.append(again.optimizer.param_groups[0]["lr"])
    again.train_on_batch(arch.x, arch.y)
    lrs.append(again.optimizer.param_groups[0]["lr"])
    state = again.state_dict()
    ref, want_lr = one_process(whole, arch, 3)
    diff = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items() if v.is_floating_point())
    return {"lrs": lrs, "want_lr": want_lr, "diff": diff, "last_epoch": again.lr_scheduler.last_epoch}


@pytest.mark.timeout(300)
def test_the_schedule_steps_with_the_optimizer_and_resumes_in_another_layout(tmp_path):
    for r in run_ranks(2, scheduled, str(tmp_path / "ckpt"), timeout=280):
        assert r["lrs"] == [0.05, 0.05, 0.025] and r["want_lr"] == 0.025 and r["last_epoch"] == 3, r
        assert r["diff"] <= 2e-5, r  # Hugging Face models' tolerance (tests/test_real_models.py)


def test_a_scheduler_that_is_not_a_function_is_refused():
    with pytest.raises(plait.ConfigError, match="lr_scheduler must be a function of the optimizer"):
        plait.Model(torch.nn.Linear(2, 2), plait.Config(), optimizer=sgd, loss=torch.nn.MSELoss(), lr_scheduler=3)
