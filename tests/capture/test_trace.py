"""Capture: torch.export first, torch.fx when export fails, a clear error when both fail (the cut
itself: tests/capture/test_split.py)."""

import pytest
import torch
from torch import nn

from plait.capture.split import split, stage_of_layers
from plait.capture.trace import capture
from plait.errors import CaptureError
from tests.models import TinyGPT, make


def run_stages(captured, layers_per_stage, args):
    """Run the split stages in order in one process, as the pipeline would across ranks."""
    stages = split(captured, stage_of_layers(layers_per_stage))
    inputs = captured.bind(args, {})
    carried: list = []
    for st in stages:
        out = st.module(*carried, *[inputs[i] for i in st.input_indices])
        carried = list(out) if not st.is_last else out
    return captured.finish(carried), stages


def test_export_captures_gpt_and_split_runs_like_the_model():
    torch.manual_seed(0)
    net = TinyGPT()
    idx = torch.randint(0, 32, (5, 8))
    captured = capture(net, (idx[:2],), {})
    assert captured.method == "torch.export"
    names = captured.layers.layer_names
    assert names[0] == "wte" and names[-1] == "lm_head"
    out, stages = run_stages(captured, [3, len(names) - 6, 3], (idx,))  # 5 rows: batch dim is dynamic
    torch.testing.assert_close(out.logits, net(idx).logits)
    # the tied embedding / head weight is used on the first and the last stage
    first = {id(p) for p in stages[0].parameters()}
    last = {id(p) for p in stages[-1].parameters()}
    assert id(net.wte.weight) in first & last


def test_tuple_in_dict_out():
    net, x, _, _ = make("tupledict")
    captured = capture(net, (x[0][:2], x[1][:2]), {})
    out, _ = run_stages(captured, [1, 1, 2], x)
    want = net(*x)
    assert set(out) == {"logits", "aux"}
    torch.testing.assert_close(out, want)


def test_fx_fallback_when_export_fails(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("export refused for this test")

    monkeypatch.setattr(torch.export, "export", refuse)
    net, x, _, _ = make("mlp")
    captured = capture(net, (x[:2],), {})
    assert captured.method == "torch.fx"
    out, _ = run_stages(captured, [4, 7], (x,))
    torch.testing.assert_close(out, net(x))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor's value: neither tracer can follow it
            return self.l(x)
        return -self.l(x)


def test_untraceable_model_names_the_construct():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(2, 4),), {})
    message = str(info.value)
    assert "DataDependent" in message and "torch.export" in message and "torch.fx" in message
    assert "control flow" in message


def test_keyword_inputs_bind_by_name():
    class KW(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x, mask=None):
            return self.b(self.a(x) * mask)

    net = KW()
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    captured = capture(net, (), {"x": x[:2], "mask": mask[:2]})
    stages = split(captured, [0, 1])
    inputs = captured.bind((), {"x": x, "mask": mask})
    h = stages[0].module(*[inputs[i] for i in stages[0].input_indices])
    out = stages[1].module(*h, *[inputs[i] for i in stages[1].input_indices])
    torch.testing.assert_close(captured.finish(out), net(x, mask=mask))


class Raises(nn.Module):
    """A forward that raises by itself, as a user's bug does: no tracer can get past it."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.l, self.norm, self.error = nn.Linear(4, 4), nn.BatchNorm1d(4), error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.l(x))
        raise self.error


class ShapeBug(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) @ torch.ones(3, 3)  # (B, 4) @ (3, 3): the user's own shape error


@pytest.mark.parametrize("net, kind, line", [
    (Raises(ValueError("the mask has the wrong length")), "ValueError: the mask has the wrong length",
     "raise self.error"),
    (ShapeBug(), "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x4 and 3x3)",
     "return self.block(x) @ torch.ones(3, 3)"),
])
def test_a_forward_that_raises_by_itself_is_named_as_the_models_code_at_its_line(net, kind, line):
    """The story: an ordinary exception in the user's forward came out as a CaptureError pointing into
    torch's module.py (or, from a submodule, as the bare exception after the fallbacks) that advised
    avoiding data-dependent control flow. Now it says the model's code raised, what and where; the
    user's exception is the cause (Python prints its traceback first), and no state moved."""
    from plait.capture.trace import capture_batch
    from plait.errors import ModelError

    stats = [b.clone() for b in net.buffers()]
    with pytest.raises(ModelError) as info:
        capture_batch(net, torch.randn(5, 4))
    message = str(info.value)
    assert message.startswith(f"the model's code raised {kind}\n"), message
    assert 'test_trace.py", line' in message and f"in forward: {line}" in message, message
    assert "not a tracing limit" in message and "control flow" not in message, message
    assert type(info.value.__cause__).__name__ == kind.split(":")[0] and info.value.__cause__.__context__ is None
    assert all(torch.equal(a, b) for a, b in zip(stats, net.buffers()))  # batch norm's statistics as they were


def test_a_tracing_limit_keeps_its_advice_through_capture_batch():
    """Data-dependent control flow runs without plait: a tracer's limit, whose advice stays."""
    from plait.capture.trace import capture_batch

    with pytest.raises(CaptureError) as info:
        capture_batch(DataDependent(), torch.randn(2, 4))
    assert "control flow" in str(info.value) and "model's code raised" not in str(info.value)
