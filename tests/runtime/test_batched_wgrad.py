"""Linear weight gradients batched over micro-batches: which linears are rewritten, and that the
step's gradients equal those of one backward per micro-batch."""

from __future__ import annotations

import torch
from torch import nn

from plait.capture.split import split
from plait.capture.trace import capture
from plait.runtime.batched_wgrad import defer_linear_weight_grads


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: used by the embedding and by the head

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids))))  # (B, T, 10)


def one_stage(net, sample):
    captured = capture(net, (sample,), {})
    return split(captured, [0] * len(captured.layers.layer_names))[0].module


def test_only_linears_whose_weights_nothing_else_uses_are_rewritten():
    torch.manual_seed(0)
    net = TiedHead()
    module = one_stage(net, torch.randint(0, 10, (2, 3)))
    batch = defer_linear_weight_grads(module)
    assert batch is not None and len(batch.anchors) == 1  # body; not the tied head
    deferred = [m for name, m in module.named_children() if name.startswith("plait_deferred_linear")]
    assert [m.weight is net.body.weight for m in deferred] == [True]
    assert "aten.linear.default" in module.code or "torch.ops.aten.linear" in module.code  # the head's


def test_batched_gradients_equal_one_backward_per_microbatch_and_fire_hooks_once():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ref = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ref.load_state_dict(net.state_dict())
    x = torch.randn(9, 5)
    module = one_stage(net, x[:4])
    batch = defer_linear_weight_grads(module)
    assert batch is not None and len(batch.anchors) == 2
    fired = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    for rows in (slice(0, 4), slice(4, 9)):  # two micro-batches of 4 and 5 rows
        (module(x[rows])[0] ** 2).sum().backward()
        (ref(x[rows]) ** 2).sum().backward()
    assert all(p.grad is None for p in net.parameters()) and not fired  # nothing until the flush
    batch.flush()
    assert sorted(fired) == sorted(id(p) for p in net.parameters())  # once per parameter
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    batch.flush()  # a second flush has nothing left to add
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_without_gradients_the_rewritten_module_is_the_plain_linear():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 2))
    x = torch.randn(3, 4)
    module = one_stage(net, x)
    defer_linear_weight_grads(module)
    with torch.no_grad():
        torch.testing.assert_close(module(x)[0], net(x))


def test_the_flush_hands_its_gradients_over_without_copying_them():
    # dW is made inside a backward, so AccumulateGrad keeps that tensor as .grad: no copy of a
    # weight-sized tensor in the flush (one passed to autograd.backward would be cloned).
    from torch.profiler import profile

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32))
    x = torch.randn(6, 64)
    module = one_stage(net, x)
    batch = defer_linear_weight_grads(module)
    assert batch is not None
    for rows in (slice(0, 3), slice(3, 6)):
        module(x[rows])[0].sum().backward()
    with profile(record_shapes=True) as prof:
        batch.flush()
    copied = [e.input_shapes for e in prof.events() if e.name == "aten::copy_"]
    assert [32, 64] not in [shape for shapes in copied for shape in shapes], copied
    assert [32] not in [shape for shapes in copied for shape in shapes], copied
    torch.testing.assert_close(net[0].weight.grad, torch.ones(6, 32).t().mm(x))
