"""Received activations behave like the tensors the stage would have seen in one process.

Two models do on purpose what broke real ones, each cut where it hurts:
- `ReluInPlace`, `WritesThroughView`: the stage after the cut writes the activation it received
  in place (`nn.ReLU(inplace=True)` on it, or `h[:, 0] = ...` through a view). A received activation is
  a leaf that requires grad, which autograd forbids writing; plait hands it over as a copy.
- `TransposedAcross`: a transposed (non-contiguous) activation crosses the cut and the next
  stage transposes it back and calls `view`, which works only on the sender's strides; the wire
  rebuilds them.
Each trains 3 SGD-with-momentum steps on 2 ranks equal to one process (losses, every parameter),
under 1F1B, ZB-H1 (the backward split in B and W) and 1F1B with recomputation (the copy is made
inside the recomputed call, so the recomputation starts from the value received).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import plait
from plait.capture.trace import capture_batch
from tests.alongside import state_problems, train_alongside
from tests.harness import run_ranks


class ReluInPlace(nn.Module):
    """Layers a, act, head; act (`nn.ReLU(inplace=True)`) writes a's output, received across a cut after a."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(6, 6), nn.Linear(6, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 6)
        return self.head(self.act(self.a(x)))  # (B, 3)


class WritesThroughView(nn.Module):
    """Layers a, b, head; b's code writes a's output, received across a cut after a, through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 6)
        h = self.a(x)  # layer 0
        g = self.b(x)  # layer 1
        h[:, 0] = g[:, 0]  # still layer 1: writes h through a view (select, copy_)
        return self.head(h)  # layer 2, (B, 3)


class TransposedAcross(nn.Module):
    """Layers a, b, head; a's output crosses the cut transposed, b's code views it back."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(24, 24), nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 4, 6)
        h = self.a(x).transpose(1, 2)  # layer 0: (B, 6, 4), not contiguous
        g = self.b(x.flatten(1))  # layer 1: (B, 24)
        h = h.transpose(1, 2).view(h.shape[0], 24)  # layer 1's code: merging dims needs the sender's strides
        return self.head(g + h)  # layer 2, (B, 3)


CASES = {  # name -> model, input shape, cut (layers per stage)
    "relu_inplace": (ReluInPlace, (6,), (1, 2)),
    "setitem_through_view": (WritesThroughView, (6,), (1, 2)),
    "transposed": (TransposedAcross, (4, 6), (1, 2)),
}
SETTINGS = {"1f1b": {"schedule": "1f1b"}, "zbh1": {"schedule": "zbh1"},
            "recompute": {"schedule": "1f1b", "recompute": True}}


def train_and_compare(name: str, setting: str) -> list[str]:
    """3 steps with plait and in one process; what differs."""
    make, shape, cut = CASES[name]
    torch.manual_seed(0)
    net = make()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, *shape, generator=g), torch.randint(0, 3, (12,), generator=g)
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    model = plait.Model(net, plait.Config(layers_per_stage=cut, num_microbatches=2, timeout_s=30.0,
                                          **SETTINGS[setting]),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss=loss_fn)
    problems = train_alongside(model, ref, ref_opt, loss_fn, [(x[a:a + 4], y[a:a + 4]) for a in (0, 4, 8)])
    return problems + state_problems(model.state_dict(), ref.state_dict())


def train_all(rank: int, world: int) -> dict[str, list[str]]:
    out = {}
    for name in CASES:
        for setting in SETTINGS:
            try:
                out[f"{name}/{setting}"] = train_and_compare(name, setting)
            except Exception as e:  # noqa: BLE001 - reported per case
                out[f"{name}/{setting}"] = [f"{type(e).__name__}: {str(e)[:1500]}"]
    return out


def test_the_cuts_fall_where_they_hurt() -> None:
    # The cases' cuts put the write / the view on the stage that receives the value.
    for name, (make, shape, cut) in CASES.items():
        captured = capture_batch(make(), torch.randn(2, *shape))
        assert len(captured.layers.layer_names) == sum(cut), (name, captured.layers.layer_names)


@pytest.mark.timeout(300)
def test_two_stages_equal_one_process() -> None:
    report = run_ranks(2, train_all, timeout=280)
    problems = [f"rank {r} {case}: {p}" for r, cases in enumerate(report) for case, ps in cases.items() for p in ps]
    assert not problems, "\n".join(problems)
