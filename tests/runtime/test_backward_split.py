"""B then W on a stage's autograd graph gives exactly the gradients of one ordinary backward."""

import copy

import pytest
import torch
from torch import nn

from plait.runtime.backward_split import SplitPlans, backward_input


class Chain(nn.Module):  # the common case: every layer's weight hangs off the input path
    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(6, 8), nn.Linear(8, 5), nn.LayerNorm(5)

    def forward(self, x):
        return [self.norm(self.b(torch.relu(self.a(x))))]


class Reused(nn.Module):  # one weight used near the output and near the input: falls back to B = all
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x):
        return [self.a(torch.tanh(self.a(x)))]


class Branches(nn.Module):  # two outputs, one of which does not depend on the input at all
    def __init__(self):
        super().__init__()
        self.a, self.bias = nn.Linear(6, 6), nn.Parameter(torch.randn(6))
        self.c = nn.Linear(6, 4)

    def forward(self, x):
        left, right = self.a(x).chunk(2, dim=1)
        return [left * right + self.c(self.a(x)).sum(), self.bias * 2]


def _reference(net, x, grads):
    x = x.clone().requires_grad_(True)
    torch.autograd.backward(net(x), grads)
    return x.grad, {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [Chain, Reused, Branches])
def test_b_then_w_equals_one_backward(make):
    torch.manual_seed(0)
    net = make()
    ref_net = copy.deepcopy(net)
    x = torch.randn(4, 6)
    outputs_shape = [o.shape for o in ref_net(x)]
    grads = [torch.randn(s) for s in outputs_shape]
    ref_dx, ref_grads = _reference(ref_net, x, grads)

    leaf = x.clone().requires_grad_(True)
    outputs = net(leaf)
    (dx,), weights = backward_input(outputs, grads, [leaf], list(net.parameters()))
    torch.testing.assert_close(dx, ref_dx, rtol=1e-6, atol=1e-7)
    if make is not Reused:  # W still to run: no weight gradient yet
        assert all(p.grad is None for p in net.parameters())
    weights.run()
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.timeout(60)
def test_stage_without_grad_inputs_defers_everything():
    """Stage 0 receives no activations that need a gradient: B is empty, W is the whole backward."""
    torch.manual_seed(0)
    net = Chain()
    ref_net = copy.deepcopy(net)
    x = torch.randn(4, 6)
    grads = [torch.randn(4, 5)]
    torch.autograd.backward(ref_net(x), grads)
    input_grads, weights = backward_input(net(x), grads, [], list(net.parameters()))
    assert input_grads == [] and all(p.grad is None for p in net.parameters())
    weights.run()
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.timeout(60)
def test_micro_batches_accumulate_like_backward():
    torch.manual_seed(0)
    net = Chain()
    ref_net = copy.deepcopy(net)
    xs, gs = torch.randn(3, 4, 6), torch.randn(3, 4, 5)
    pending = []
    for x, g in zip(xs, gs):
        torch.autograd.backward(ref_net(x), [g])
        leaf = x.clone().requires_grad_(True)
        pending.append(backward_input(net(leaf), [g], [leaf], list(net.parameters()))[1])
    for w in pending:
        w.run()
    for p, q in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class Swapped(nn.Module):  # one graph shape, two wirings: which linear is near the input depends on a flag
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.swap = False

    def forward(self, x):
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return [second(torch.tanh(first(x)))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [Chain, Reused, Branches])
def test_analysis_kept_per_graph_gives_the_same_gradients(make):
    """The stage's analysis is done once for micro-batches that record the same graph, and the
    reused analysis gives exactly the gradients of ordinary backward passes."""
    torch.manual_seed(0)
    net = make()
    ref_net = copy.deepcopy(net)
    xs = torch.randn(3, 4, 6)
    plans, pending, ref_dx, dx = SplitPlans(), [], [], []
    for x in xs:
        outputs = net(leaf := x.clone().requires_grad_(True))
        grads = [torch.ones_like(o) * (1 + i) for i, o in enumerate(outputs)]
        ref_dx.append(_reference(ref_net, x, grads)[0])
        (d,), weights = backward_input(outputs, grads, [leaf], list(net.parameters()), plans)
        dx.append(d)
        pending.append(weights)
    assert len(plans) == 1
    for w in pending:
        w.run()
    for got, want in zip(dx, ref_dx):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for p, q in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_a_graph_wired_otherwise_is_analysed_anew():
    """Same nodes, same shapes, the parameters swapped along the path: a reused analysis would send
    each weight's gradient to the other one; the second wiring gets its own analysis."""
    torch.manual_seed(0)
    net = Swapped()
    ref_net = copy.deepcopy(net)
    plans = SplitPlans()
    for swap in (False, True, False, True):
        net.swap = ref_net.swap = swap
        x, g = torch.randn(4, 6), torch.randn(4, 6)
        ref_dx, _ = _reference(ref_net, x, [g])
        (dx,), weights = backward_input(net(leaf := x.clone().requires_grad_(True)), [g], [leaf],
                                        list(net.parameters()), plans)
        weights.run()
        torch.testing.assert_close(dx, ref_dx, rtol=1e-6, atol=1e-7)
        for p, q in zip(net.parameters(), ref_net.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert len(plans) == 2
