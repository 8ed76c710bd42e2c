"""Modules kept whole: found where torch.export stops, or named; one opaque call that runs, and
differentiates, exactly as the module does in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plait.capture.opaque import modules_to_keep
from plait.capture.split import split
from plait.capture.trace import capture, capture_batch
from plait.errors import CaptureError
from tests.moe import MoENet, Router


def _run_whole(captured, x):
    (stage,) = split(captured, [0] * len(captured.layers.layer_names))
    return captured.finish(stage.module(x))


def _compare(net: nn.Module, ref: nn.Module, captured, x: torch.Tensor, seed: int = 0) -> None:
    torch.manual_seed(seed)
    out = _run_whole(captured, x)
    out.pow(2).sum().backward()
    torch.manual_seed(seed)
    want = ref(x)
    want.pow(2).sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    for (name, b), c in zip(net.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=0, atol=0, msg=name)


def test_export_stopping_in_a_router_keeps_every_router_whole_and_traces_the_rest():
    torch.manual_seed(0)
    net = MoENet()
    ref = copy.deepcopy(net)
    captured = capture_batch(net, torch.randn(4, 6))
    assert captured.method == "torch.export"
    assert captured.kept_whole == ("moe1", "moe2")  # one stop, the class kept: both routers
    assert captured.layers.layer_names == ("a", "moe1", "b", "moe2", "head")
    x = torch.randn(9, 6)  # another batch size, other rows per expert
    _compare(net, ref, captured, x)


def test_a_kept_module_draws_the_same_dropout_in_its_recomputed_backward():
    torch.manual_seed(0)
    net = MoENet(dropout=0.5)
    ref = copy.deepcopy(net)
    captured = capture_batch(net, torch.randn(4, 6))
    _compare(net, ref, captured, torch.randn(8, 6), seed=3)


def test_a_kept_module_on_a_gpu_recomputes_from_that_gpu_s_generator_state(monkeypatch):
    # Dropout on a GPU draws from that GPU's generator, not the CPU's: the recomputation must start
    # from the state the forward found on it (else it draws other masks), and leave it as it was.
    # No GPU here: the modules run on the CPU, told they run on cuda:3, whose generator is a fake.
    from plait.capture import opaque

    torch.manual_seed(0)
    net = MoENet(dropout=0.5)
    captured = capture_batch(net, torch.randn(4, 6))
    gpu = torch.device("cuda", 3)
    state = {gpu: torch.tensor([10], dtype=torch.uint8)}
    restored = []
    monkeypatch.setattr(opaque, "_cuda_device", lambda tensors: gpu)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: state[torch.device(device)].clone())

    def set_rng_state(new, device):
        restored.append((int(new[0]), torch.device(device)))
        state[torch.device(device)] = new.clone()

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    out = _run_whole(captured, torch.randn(8, 6))  # both kept modules find the GPU's state at 10
    state[gpu] = torch.tensor([20], dtype=torch.uint8)  # other work on the GPU draws meanwhile
    out.pow(2).sum().backward()
    assert restored == [(10, gpu), (20, gpu)] * 2  # each recomputation: the forward's state, then back
    assert int(state[gpu][0]) == 20


def test_a_kept_module_runs_on_the_device_of_its_first_gpu_tensor():
    from types import SimpleNamespace

    from plait.capture.opaque import _cuda_device

    on = [SimpleNamespace(device=torch.device(d)) for d in ("cpu", "cuda:1", "cuda:0")]
    assert _cuda_device(on) == torch.device("cuda", 1)
    assert _cuda_device(on[:1]) is None and _cuda_device([torch.zeros(1)]) is None


def test_a_kept_module_with_buffers_updates_them_once_per_forward():
    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.block(x))

    torch.manual_seed(0)
    net = WithNorm()
    ref = copy.deepcopy(net)
    captured = capture(net, (torch.randn(3, 4),), {}, keep=["block"])
    assert captured.kept_whole == ("block",) and captured.layers.layer_names == ("block", "head")
    _compare(net, ref, captured, torch.randn(5, 4))  # running mean/var compared exactly


def test_keep_by_class_name_or_class_and_unknown_names_are_errors():
    net = MoENet()
    assert modules_to_keep(net, [Router]) == ["moe1", "moe2"]
    assert modules_to_keep(net, ["moe2", "moe2.gate"]) == ["moe2"]  # inside a kept module: part of it
    with pytest.raises(CaptureError, match=r"'moe3', which is not a submodule of MoENet.*similar.*moe1"):
        modules_to_keep(net, ["moe3"])


def test_a_model_that_cannot_be_captured_names_the_module_the_line_and_the_option():
    class Sizes(nn.Module):
        def forward(self, x):
            return x[x > 0]  # an output whose size depends on the values

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.pick = nn.Linear(4, 4), Sizes()

        def forward(self, x):
            h = self.pick(self.a(x))
            if h.numel() > 3:  # data-dependent control flow in the model itself
                h = h * 2
            return h.sum()

    with pytest.raises(CaptureError) as info:
        capture(Net(), (torch.randn(3, 4),), {})
    message = str(info.value)
    assert "torch.export(strict=False) stopped in" in message
    assert "torch.fx.symbolic_trace stopped in the model's own forward (Net)" in message
    assert "if h.numel() > 3" in message  # the line
    assert "move it into a submodule and keep that whole: Config(leaf_modules=" in message


def test_a_kept_module_whose_output_size_follows_the_data_is_refused_when_it_runs():
    class Positives(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # export stops here: plait keeps the module whole
                return x[x > 0]
            return x.flatten()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.pick = nn.Linear(4, 4), Positives()

        def forward(self, x):
            return self.pick(self.a(x)).sum()

    torch.manual_seed(0)
    net = Net()
    captured = capture(net, (torch.randn(2, 4),), {})
    assert captured.kept_whole == ("pick",)
    with pytest.raises(CaptureError, match="its output size depends on the data"):
        for seed in range(20):  # some batch has another count of positives than the rule says
            _run_whole(captured, torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)))


class _NoneArguments(nn.Module):
    """A block called as Hugging Face layers are: a None mask and head mask, a flag, a tensor last."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x, mask=None, head_mask=None, flag=True, scale=None):
        assert mask is None and head_mask is None and flag is True
        return self.proj(x) * scale


class _CallsWithNones(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _NoneArguments()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.block(x, None, head_mask=None, flag=True, scale=x.sigmoid()))


def test_a_kept_module_called_with_none_arguments_gets_them_back():
    # Regression (transformers 4.57's OPT and BART, whose decoders are kept whole): a None
    # argument is a pytree leaf like a tensor, and None also marked where a tensor goes, so
    # rebuilding the call ran out of tensors (StopIteration) and the block never ran.
    torch.manual_seed(0)
    net = _CallsWithNones()
    ref = copy.deepcopy(net)
    captured = capture_batch(net, torch.randn(4, 6), keep=("block",))
    assert captured.kept_whole == ("block",)
    _compare(net, ref, captured, torch.randn(5, 6))
