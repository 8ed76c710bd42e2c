"""Recomputation repeats the forward's dropout masks: training with and without it is bit for bit the same.

Each rank draws its dropout masks from its own process's generator, in the order of its
micro-batches' forwards. A recomputed stage (Config(recompute=True)) runs its forward again in
the backward under torch.utils.checkpoint -- whole, or layer by layer (recompute_by_layer) --
which restores the generator's state of the first forward and leaves the generator as it was:
the masks, and so every gradient, are the same as without recomputation. A recomputed forward
that drew new masks would give other gradients.

One process can do the same with one generator state per stage: with each rank's generator
seeded as the test seeds it, the reference below draws stage s's masks from seed 100 + s, and
plait's training equals it (fp32: rtol 1e-5, atol 1e-6; the sums run in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from tests.harness import run_ranks

CUT = (3, 4)  # a dropout on each stage
ROWS, MICROBATCHES, STEPS = 9, 3, 2  # micro-batches of 3 rows
SCHEDULES = ["gpipe", "1f1b", "zbh1"]
SEED = 100  # rank r's generator is seeded SEED + r once the model is built


def dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(),
                         nn.Dropout(0.3), nn.Linear(16, 4))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS * STEPS, 8, generator=g), torch.randint(0, 4, (ROWS * STEPS,), generator=g)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(rank: int, world: int) -> dict:
    x, y = data()
    out = {}
    for schedule in SCHEDULES:
        for recompute in (False, True, "by layer"):
            net = dropout_mlp()
            model = plait.Model(net, plait.Config(layers_per_stage=CUT, num_microbatches=MICROBATCHES,
                                                  schedule=schedule, recompute=bool(recompute),
                                                  recompute_by_layer=recompute == "by layer"),
                                optimizer=sgd, loss=nn.CrossEntropyLoss())
            model.build(x[:ROWS])
            torch.manual_seed(SEED + rank)
            losses = [model.train_on_batch(x[a:a + ROWS], y[a:a + ROWS]) for a in range(0, ROWS * STEPS, ROWS)]
            grads = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
            out[(schedule, recompute)] = {"losses": losses, "grads": grads, "state": model.state_dict(),
                                          "recomputed": list(model.plan.recompute),
                                          "by_layer": list(model.plan.recompute_by_layer)}
    return out


def reference() -> dict[str, torch.Tensor]:
    """One process, stage s's dropout masks drawn from a generator seeded SEED + s."""
    x, y = data()
    net = dropout_mlp()
    stages = [net[:CUT[0]], net[CUT[0]:]]
    opt = sgd(net.parameters())
    with torch.random.fork_rng():
        states = []
        for s in range(len(stages)):
            torch.manual_seed(SEED + s)
            states.append(torch.get_rng_state())
        for a in range(0, ROWS * STEPS, ROWS):
            opt.zero_grad()
            size = ROWS // MICROBATCHES
            for lo in range(a, a + ROWS, size):
                h = x[lo:lo + size]
                for s, stage in enumerate(stages):
                    torch.set_rng_state(states[s])
                    h = stage(h)
                    states[s] = torch.get_rng_state()
                (F.cross_entropy(h, y[lo:lo + size]) * (size / ROWS)).backward()
            opt.step()
    return net.state_dict()


@pytest.mark.timeout(180)
def test_recomputed_stages_repeat_their_dropout_masks():
    results = run_ranks(2, train, timeout=170)
    want = reference()
    for rank, runs in enumerate(results):
        for schedule in SCHEDULES:
            kept = runs[(schedule, False)]
            assert kept["recomputed"] == [] and kept["grads"], f"rank {rank}, {schedule}"
            for name, value in kept["state"].items():
                torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"rank {rank}, {schedule}: {n} against one process: {m}")
            for how, by_layer in ((True, []), ("by layer", [0, 1])):  # the stage whole, or layer by layer
                again, where = runs[(schedule, how)], f"rank {rank}, {schedule}, recomputed {how}"
                assert again["recomputed"] == [0, 1] and again["by_layer"] == by_layer, where
                assert again["losses"] == kept["losses"], where
                assert again["grads"].keys() == kept["grads"].keys(), where
                for name, grad in kept["grads"].items():
                    assert torch.equal(again["grads"][name], grad), f"{where}: gradient of {name}"
                for name, value in kept["state"].items():
                    assert torch.equal(again["state"][name], value), f"{where}: {name} after training"
