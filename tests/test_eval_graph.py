"""evaluate and predict run a graph captured in eval mode, with torch.export and with the torch.fx
fallback alike; fit runs the one captured in train mode.

Both tracers bake `self.training` into the graph: torch.fx reads it once while tracing, so
`F.dropout(x, p, self.training)` and `if self.training:` become fixed code. The story: plait
captured an eval graph only for torch.export; a model that fell back to torch.fx evaluated and
predicted with its training graph, dropout and training-only branch on (predict differed from
eval-mode torch by up to 0.78 on a small model, and two predicts disagreed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.capture.trace import capture_batch
from plait.errors import CaptureError
from tests.harness import run_ranks

CUT = (2, 2)  # stage 0: l1, l2; stage 1: l3, l4 -- functional dropout and a training branch on each
METHODS = ["torch.export", "torch.fx"]


class FunctionalDropout(nn.Module):
    """Dropout by `F.dropout(x, p, self.training)` and a branch that only training runs, on both
    sides of the cut: neither is a module a tracer keeps as a call, so the mode is in the graph."""

    def __init__(self, p: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 16)
        self.l3, self.l4 = nn.Linear(16, 16), nn.Linear(16, 4)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.l1(x))  # (B, 16)
        x = F.dropout(x, self.p, self.training)
        if self.training:
            x = x + 0.5
        x = torch.tanh(self.l2(x))  # (B, 16), the last of stage 0
        x = torch.tanh(self.l3(x))  # (B, 16)
        if self.training:
            x = x * 2.0
        x = F.dropout(x, self.p, self.training)
        return self.l4(x)  # (B, 4)


def data(n: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def flags(net: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in net.named_modules()}


def _refuse_export(*args: object, **kwargs: object) -> None:
    raise RuntimeError("torch.export refused for this test: plait falls back to torch.fx")


def eval_mode_reference(state: dict[str, torch.Tensor], p: float, x: torch.Tensor,
                        y: torch.Tensor) -> dict[str, object]:
    """One process, the parameters plait trained: eval-mode outputs and loss, and whether train
    mode would give other outputs (else the test could not tell the graphs apart)."""
    ref = FunctionalDropout(p)
    ref.load_state_dict(state)
    with torch.no_grad():
        want = ref.eval()(x)
        differs = not torch.allclose(ref.train()(x), want)
    return {"want": want, "want_loss": float(F.cross_entropy(want, y)), "train_mode_differs": differs}


def fit_evaluate_predict(rank: int, world: int, method: str) -> dict[str, object]:
    if method == "torch.fx":  # this rank's process only (spawned): export fails, as on a model it rejects
        torch.export.export = _refuse_export
    x, y = data()
    out: dict[str, object] = {}
    for p in (0.0, 0.5):  # p = 0: training is deterministic, and only the training branches differ
        net = FunctionalDropout(p)
        model = plait.Model(net, plait.Config(layers_per_stage=CUT, num_microbatches=2),
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=nn.CrossEntropyLoss())
        history = model.fit(x, y, epochs=2, batch_size=10, shuffle=False, verbose=0)
        first = model.predict(x, batch_size=7)  # in train mode: 23 rows in batches of 7, 7, 7, 2
        second = model.predict(x, batch_size=7)
        loss = model.evaluate(x, y, batch_size=5)["loss"]
        state = model.state_dict()
        out[f"p={p}"] = {
            "method": model.plan.capture_method, "losses": history.history["loss"], "state": state,
            "first": first, "second": second, "loss": loss, "flags": flags(net),
            **eval_mode_reference(state, p, x, y),
        }
    return out


def one_process_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    """fit(epochs=2, batch_size=10, shuffle=False) of the p = 0 model in one process, in train mode."""
    net = FunctionalDropout(0.0).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        total = 0.0
        for a in range(0, len(x), 10):
            opt.zero_grad()
            loss = F.cross_entropy(net(x[a:a + 10]), y[a:a + 10])
            loss.backward()
            opt.step()
            total += loss.item() * len(x[a:a + 10])
        losses.append(total / len(x))
    return losses, net.state_dict()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("method", METHODS)
def test_fit_trains_in_train_mode_and_predict_evaluate_run_in_eval_mode_with_either_capture(method: str):
    x, y = data()
    want_losses, want_state = one_process_fit(x, y)
    for rank, got in enumerate(run_ranks(2, fit_evaluate_predict, method, timeout=140)):
        for p in (0.0, 0.5):
            run = got[f"p={p}"]
            where = f"rank {rank}, {method}, p={p}"
            assert run["method"] == method, where  # the plan says how the model was captured
            assert run["train_mode_differs"], f"{where}: train mode changes nothing, the test would not see it"
            assert torch.equal(run["first"], run["second"]), f"{where}: two predicts differ"
            torch.testing.assert_close(run["first"], run["want"], rtol=1e-5, atol=1e-6, msg=where)
            assert run["loss"] == pytest.approx(run["want_loss"], rel=1e-5), where
            assert all(run["flags"].values()), f"{where}: a module left in eval mode: {run['flags']}"
        trained = got["p=0.0"]  # the training branches were on in fit: the training graph trained
        assert trained["losses"] == pytest.approx(want_losses, rel=1e-5), rank
        for name, value in want_state.items():
            torch.testing.assert_close(trained["state"][name], value, rtol=1e-5, atol=1e-6)


def test_an_fx_capture_in_eval_mode_leaves_the_training_code_out_and_the_flags_as_they_were():
    net, (x, _) = FunctionalDropout(0.5), data()
    captured = capture_batch(net, x, train=False, method="torch.fx")  # export is not tried
    assert captured.method == "torch.fx"
    assert all(flags(net).values())
    graph = torch.fx.GraphModule(captured.root, captured.graph)
    with torch.no_grad():
        got = graph(*captured.bind((x,), {}))
        torch.testing.assert_close(got, net.eval()(x), rtol=0, atol=0)


class EvalOnlyDataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.l(x)
        if not self.training and x.sum() > 0:  # control flow on a value, in eval mode only
            x = -x
        return x


def test_an_fx_capture_that_fails_in_eval_mode_names_the_mode():
    net, (x, _) = EvalOnlyDataDependent(), data()
    assert capture_batch(net, x, train=True, method="torch.fx").method == "torch.fx"
    with pytest.raises(CaptureError, match="EvalOnlyDataDependent in eval mode: torch.fx.symbolic_trace"):
        capture_batch(net, x, train=False, method="torch.fx")


class ReadByMode(nn.Module):
    """Mamba's mixer in small: training reads `scale` on stage 0 (as Mamba's training-only fused
    call takes `D` and `dt_proj.bias` after `in_proj`), eval only on stage 1 (its scan, after `x_proj`).

    The story: eval's stage 1 read `scale` itself, on rank 1, which never trained it. Rank 1 had
    freed it (predict raised "Tensor on device meta is not on the expected device cpu!"), or, with
    an optimizer instance (nothing freed), read its first value: a predict off by the training.
    Now eval reads it on stage 0, which trains it, and sends it on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))  # (B, 16), the last of stage 0
        s = self.scale * 1.0 if self.training else self.scale  # read on stage 0 in training only
        return self.b(h) * s  # (B, 4)


def train_read_by_mode(rank: int, world: int, instance: bool) -> dict[str, object]:
    x, y = data()
    net = ReadByMode()
    optimizer: object = torch.optim.SGD(net.parameters(), lr=0.5) if instance else (
        lambda params: torch.optim.SGD(params, lr=0.5))
    model = plait.Model(net, plait.Config(layers_per_stage=(1, 1), num_microbatches=2), optimizer=optimizer,
                        loss=nn.CrossEntropyLoss())
    model.fit(x, y, epochs=2, batch_size=10, shuffle=False, verbose=0)
    return {"predict": model.predict(x, batch_size=7), "loss": model.evaluate(x, y, batch_size=5)["loss"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("instance", [False, True], ids=["frees", "optimizer-instance"])
def test_a_parameter_eval_reads_on_another_stage_is_read_where_it_trained(instance: bool):
    x, y = data()
    ref = ReadByMode()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        for a in range(0, len(x), 10):
            opt.zero_grad()
            F.cross_entropy(ref(x[a:a + 10]), y[a:a + 10]).backward()
            opt.step()
    assert not torch.allclose(ref.scale, torch.full((4,), 2.0)), "scale did not train: the test would not see it"
    with torch.no_grad():
        want = ref.eval()(x)
    for rank, got in enumerate(run_ranks(2, train_read_by_mode, instance, timeout=110)):
        torch.testing.assert_close(got["predict"], want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        assert got["loss"] == pytest.approx(float(F.cross_entropy(want, y)), rel=1e-5), rank
