"""The profiler's runs of a model's layers: the whole-model pass holds its micro-batches as a stage does."""

from __future__ import annotations

import torch
from torch import nn

from plait.capture.split import split, stage_of_layers
from plait.capture.trace import capture
from plait.planner.layer_runs import LayerRuns
from plait.planner.profile import ProfileOptions


def test_the_whole_pass_keeps_held_micro_batches_alive(monkeypatch):
    # A pipeline stage holds several micro-batches' activations; the whole-model pass does too:
    # every copy's forward runs before the first backward.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    x = torch.randn(8, 5)
    cap = capture(net, (x,), {})
    run = LayerRuns(cap, split(cap, stage_of_layers([1] * len(cap.layers.layer_names))),
                    (x,), {}, 8, ProfileOptions(repeats=1))
    events: list[str] = []
    stage = run.whole_stage  # the whole model as one stage, run by the runtime's StageExecutor
    real_forward, real_backward = stage.forward, stage.backward
    monkeypatch.setattr(stage, "forward", lambda k, *a, **kw: (events.append(f"F{k}"), real_forward(k, *a, **kw))[1])
    monkeypatch.setattr(stage, "backward", lambda k, g: (events.append(f"B{k}"), real_backward(k, g))[1])
    f, b = run.whole(held=3)
    assert events == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert f > 0 and b > 0
