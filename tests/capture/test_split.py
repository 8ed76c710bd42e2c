"""Tests for plait.capture.split: which values cross each cut, which model inputs each stage takes,
and stages that run in order compute what the model computes (one process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from plait.capture.split import StageModule, split, stage_of_layers
from plait.capture.trace import capture
from plait.errors import PartitionError
from tests.models import make


def run_stages(stages: list[StageModule], inputs: list[Any]) -> Any:
    """Run the stages in order in one process, as the pipeline does across ranks."""
    carried: list[Any] = []
    for stage in stages:
        out = stage.module(*carried, *[inputs[i] for i in stage.input_indices])
        carried = out if stage.is_last else list(out)
    return carried


class Residual(nn.Module):
    """a, b: the input x is used again on b's stage, after the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + x


def test_stage_of_layers() -> None:
    assert stage_of_layers([2, 3]) == [0, 0, 1, 1, 1]
    assert stage_of_layers([1, 1, 1]) == [0, 1, 2]
    assert stage_of_layers([4]) == [0, 0, 0, 0]


def test_stages_must_not_decrease() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    captured = capture(net, (torch.randn(2, 4),), {})
    with pytest.raises(PartitionError) as info:
        split(captured, [0, 1, 0])
    assert str(info.value) == "stages of layers must not decrease, got [0, 1, 0]"


def test_a_chain_sends_one_value_across_each_cut() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    captured = capture(net, (x[:2],), {})
    stages = split(captured, stage_of_layers([2, 2, 1]))
    assert [s.stage_index for s in stages] == [0, 1, 2]
    assert [s.is_last for s in stages] == [False, False, True]
    assert [len(s.recv_names) for s in stages] == [0, 1, 1]
    assert [len(s.send_names) for s in stages] == [1, 1, 0]
    assert stages[0].send_names == stages[1].recv_names and stages[1].send_names == stages[2].recv_names
    assert [s.input_indices for s in stages] == [[0], [], []]  # only the first stage reads the input
    assert [[id(p) for p in s.parameters()] for s in stages] == [
        [id(net[0].weight), id(net[0].bias)], [id(net[2].weight), id(net[2].bias)],
        [id(net[4].weight), id(net[4].bias)]]
    torch.testing.assert_close(captured.finish(run_stages(stages, captured.bind((x,), {}))), net(x))


def test_a_model_input_used_after_the_cut_is_made_there_not_sent() -> None:
    torch.manual_seed(0)
    net, x = Residual(), torch.randn(3, 4)
    captured = capture(net, (x[:2],), {})
    assert len(captured.layers.layer_names) == 2
    stages = split(captured, [0, 1])
    assert [s.input_indices for s in stages] == [[0], [0]]
    assert len(stages[0].send_names) == 1  # a's output only: x is local to every stage
    torch.testing.assert_close(captured.finish(run_stages(stages, captured.bind((x,), {}))), net(x))


def test_a_skip_over_two_cuts_rides_through_the_middle_stage() -> None:
    net, x, _, _ = make("skip")
    captured = capture(net, (x[:2],), {})
    stages = split(captured, stage_of_layers([1, 1, 1, 3]))
    h = stages[0].send_names[0]
    assert stages[0].send_names == [h]
    assert h in stages[1].recv_names and h in stages[1].send_names  # forwarded untouched
    assert h in stages[2].recv_names and h in stages[2].send_names
    assert len(stages[1].send_names) == 2 and stages[3].recv_names == stages[2].send_names
    torch.testing.assert_close(captured.finish(run_stages(stages, captured.bind((x,), {}))), net(x))


def test_one_stage_holds_the_whole_model() -> None:
    net, x, _, _ = make("mlp")
    captured = capture(net, (x[:2],), {})
    (stage,) = split(captured, [0] * len(captured.layers.layer_names))
    assert (stage.is_last, stage.recv_names, stage.send_names, stage.input_indices) == (True, [], [], [0])
    torch.testing.assert_close(captured.finish(run_stages([stage], captured.bind((x,), {}))), net(x))


class ReadByMode(nn.Module):
    """Mamba's mixer in small: training reads `scale` after `a` (as Mamba's training-only fused call
    takes `D`), eval only after `b`; the value read in training crosses the cut."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # (B, 4)
        s = self.scale * 1.0 if self.training else self.scale  # read in a's layer in training only
        return self.b(h) * s  # (B, 4)


def test_a_tensor_read_on_a_stage_that_does_not_hold_it_is_read_on_its_holder_and_sent() -> None:
    net, x = ReadByMode(), torch.randn(3, 4)
    train = capture(net.train(), (x[:2],), {})
    held = {id(p): [s.stage_index] for s in split(train, [0, 1]) for p in s.parameters()}
    assert held[id(net.scale)] == [0]  # training reads it on stage 0
    evaluation = capture(net.eval(), (x[:2],), {})
    alone = split(evaluation, [0, 1])  # without the holders: read where eval reads it
    assert id(net.scale) in {id(p) for p in alone[1].parameters()}
    stages = split(evaluation, [0, 1], held)
    assert [{id(p) for p in s.parameters()} for s in stages] == [
        {id(net.a.weight), id(net.a.bias), id(net.scale)}, {id(net.b.weight), id(net.b.bias)}]
    assert len(stages[0].send_names) == 2 and stages[1].recv_names == stages[0].send_names  # h and scale
    with torch.no_grad():
        got = evaluation.finish(run_stages(stages, evaluation.bind((x,), {})))
        torch.testing.assert_close(got, net(x))


def test_a_tensor_read_before_every_stage_that_holds_it_is_refused() -> None:
    net, x = ReadByMode(), torch.randn(3, 4)
    evaluation = capture(net.eval(), (x[:2],), {})
    with pytest.raises(PartitionError, match=r"scale is read on stage 1 .* before stage 2 that holds it"):
        split(evaluation, [0, 1], {id(net.scale): [2]})
