"""written_placeholders: the inputs a graph writes in place, directly or through views, in export and fx graphs."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from plait.capture.mutation import written_placeholders


def _export_graph(fn, *shapes: tuple[int, ...]) -> fx.Graph:
    class Wrap(nn.Module):
        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return fn(*xs)

    return torch.export.export(Wrap(), tuple(torch.randn(s) for s in shapes), strict=False).module().graph


def _names(graph: fx.Graph, root: nn.Module | None = None) -> list[str]:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    written = written_placeholders(graph, root)
    return [str(i) for i, n in enumerate(placeholders) if n in written]


def _through_view(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x.view(-1)[0:2].add_(1)  # writes x through two views
    return x + y


def _copy_then_write(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w = x * 2  # a new tensor: writing it leaves x alone
    w.add_(y)
    return w


def _setitem(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y[:, 0] = x[:, 0]
    return y * 1


def test_export_graphs_name_the_written_inputs() -> None:
    assert _names(_export_graph(_through_view, (2, 3), (2, 3))) == ["0"]
    assert _names(_export_graph(_copy_then_write, (2, 3), (2, 3))) == []
    assert _names(_export_graph(_setitem, (2, 3), (2, 3))) == ["1"]
    assert _names(_export_graph(lambda x, y: F.relu(x, inplace=True) + y, (2, 3), (2, 3))) == ["0"]
    assert _names(_export_graph(lambda x, y: F.relu(x) + y, (2, 3), (2, 3))) == []


def test_fx_graphs_are_judged_by_name_and_modules_by_their_inplace_flag() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU(inplace=True)
            self.keep = nn.ReLU()

        def forward(self, a, b, c, d, e):
            a.transpose(0, 1).mul_(2)  # a method ending in _, through a view
            self.act(c)  # a module with inplace=True
            self.keep(d)  # not in place
            return a + b + c + d + (e * 3)

    net = Net()
    graph = fx.symbolic_trace(net).graph
    b = [n for n in graph.nodes if n.op == "placeholder"][1]
    with graph.inserting_after(b):  # `b[0] = 0`, which symbolic_trace cannot record
        graph.call_function(operator.setitem, (b, 0, 0))
    assert _names(graph, net) == ["0", "1", "2"]
    assert _names(graph, None) == ["0", "1"]  # without the root, modules cannot be looked at
