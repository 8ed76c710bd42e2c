"""The public Model: fit/evaluate/predict/state_dict, data forms, and every user error, on 1 and 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import plait
from plait.callbacks import Callback
from tests.harness import run_ranks
from tests.models import even_cut, mlp


def data(n=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def reference_fit(net, x, y, epochs, batch_size):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(epochs):
        for a in range(0, len(x), batch_size):
            opt.zero_grad()
            F.cross_entropy(net(x[a:a + batch_size]), y[a:a + batch_size]).backward()
            opt.step()


def fit_three_ways(rank, world):
    """fit on tensors, a Dataset and a DataLoader (shuffle=False) all equal the reference."""
    x, y = data()
    out = {}
    for form in ["tensors", "dataset", "loader"]:
        torch.manual_seed(1)
        net = mlp()
        ref = copy.deepcopy(net)
        model = plait.Model(net, plait.Config(layers_per_stage=even_cut(11, world), num_microbatches=3),
                            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                            loss=nn.CrossEntropyLoss(), metrics=["accuracy"])
        if form == "tensors":
            history = model.fit(x, y, epochs=2, batch_size=10, shuffle=False, verbose=0)
        elif form == "dataset":
            history = model.fit(TensorDataset(x, y), epochs=2, batch_size=10, shuffle=False, verbose=0)
        else:
            history = model.fit(DataLoader(TensorDataset(x, y), batch_size=10), epochs=2, verbose=0)
        reference_fit(ref, x, y, epochs=2, batch_size=10)
        state = model.state_dict()
        diff = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items())
        ref.eval()
        with torch.no_grad():
            want_loss = float(F.cross_entropy(ref(x), y))
            want_acc = float((ref(x).argmax(-1) == y).float().mean())
        result = model.evaluate(x, y, batch_size=7)
        out[form] = (diff, result, want_loss, want_acc, history.history)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_fit_on_tensors_datasets_and_loaders_equals_one_process(world):
    results = run_ranks(world, fit_three_ways, timeout=110)
    for rank_result in results:
        for form, (diff, result, want_loss, want_acc, history) in rank_result.items():
            assert diff < 1e-6, (form, diff)
            assert result["loss"] == pytest.approx(want_loss, rel=1e-5), form
            assert result["accuracy"] == pytest.approx(want_acc), form
            assert len(history["loss"]) == 2 and len(history["accuracy"]) == 2
    # evaluate returns the same dict on every rank
    assert all(r["tensors"][1] == results[0]["tensors"][1] for r in results)


def test_single_process_round_trip_and_plan():
    x, y = data()
    net = mlp()
    model = plait.Model(net, optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
                        loss=nn.CrossEntropyLoss())
    with pytest.raises(plait.PlaitError, match="first sees data"):
        model.plan
    loss = model.train_on_batch(x, y)
    assert isinstance(loss, float) and loss > 0
    assert model.plan.layer_names[0] == "0" and model.plan.layers_per_stage == (11,)
    assert plait.Plan.from_json(model.plan.to_json()) == model.plan
    state = model.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in state.items()} == {
        k: (v.shape, v.dtype) for k, v in net.state_dict().items()}
    net2 = mlp()
    net2.load_state_dict(state)
    torch.testing.assert_close(model.predict(x, batch_size=5), net2(x).detach())


def test_more_microbatches_than_rows_warns_and_clamps():
    x, y = data(n=3)
    model = plait.Model(mlp(), plait.Config(num_microbatches=8), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=nn.CrossEntropyLoss())
    with pytest.warns(UserWarning, match="num_microbatches=8 is more than the 3 rows"):
        model.train_on_batch(x, y)


def test_loss_that_is_not_a_scalar():
    x, y = data()
    model = plait.Model(mlp(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(plait.LossError, match=r"returned \(23,\), not a scalar.*reduction='mean'"):
        model.train_on_batch(x, y)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_microbatches": 0}, "num_microbatches must be a positive integer, got 0"),
    ({"schedule": "zigzag"},
     r"schedule='zigzag' is not known; choose one of \['gpipe', '1f1b', 'interleaved', 'zbh1'\]"),
    ({"num_virtual_stages": 2}, "num_virtual_stages=2 needs schedule='interleaved', got schedule='1f1b'"),
    ({"num_virtual_stages": 0, "schedule": "interleaved"}, "num_virtual_stages must be a positive integer"),
    ({"schedule": "interleaved", "num_virtual_stages": 2, "layers_per_stage": [1, 2, 3]},
     r"has 3 entries, not a multiple of num_virtual_stages=2"),
    ({"recompute": "sometimes"}, r"recompute='sometimes' is not known; use True, False, 'auto'"),
    ({"recompute": [0, -1]}, r"bad entries: \[-1\]"),
    ({"batch_weight_grads": 1}, "batch_weight_grads must be True or False .or None: the planner's choice., got 1"),
    ({"layers_per_stage": [2, 0]}, r"bad entries: \[0\]"),
    ({"layers_per_stage": [2, 2], "num_stages": 3}, "num_stages=3 but layers_per_stage=\\[2, 2\\]"),
    ({"timeout_s": -1}, "timeout_s must be a positive number"),
    ({"checkpoint_dir": 3}, "checkpoint_dir must be a directory path or None, got 3"),
    ({"plan": 3}, "plan must be the path of a plan JSON file or None, got 3"),
    ({"plan": "p.json", "layers_per_stage": [1, 1]}, r"plan='p.json' and layers_per_stage=\[1, 1\] both give"),
    ({"replan": "yes"}, r"replan must be True, False or None \(as `plait run --replan` says\), got 'yes'"),
])
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(plait.ConfigError, match=message):
        plait.Config(**kwargs)


def test_config_paths_may_be_path_objects(tmp_path):
    config = plait.Config(checkpoint_dir=tmp_path, plan=tmp_path / "p.json")
    assert config.checkpoint_dir == str(tmp_path) and config.plan == str(tmp_path / "p.json")


class Reuse(nn.Module):
    """Calls the batch norm `a` again after `b`: its running statistics make layers a, b, a#1 one
    uncuttable region (a reused module with parameters only would be cut between its calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.c(self.a(torch.tanh(self.b(self.a(x)))))


def user_errors(rank, world):
    x, y = data()
    errors = {}
    cases = {
        "sum": (mlp(), plait.Config(layers_per_stage=[2, 2])),
        "world": (mlp(), plait.Config(layers_per_stage=[4, 4, 3])),
        "region": (Reuse(), plait.Config(layers_per_stage=[1, 3])),
        "stages": (nn.Sequential(nn.Linear(8, 4)), plait.Config(num_stages=2)),
    }
    for name, (net, config) in cases.items():
        try:
            model = plait.Model(net, config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                loss=nn.CrossEntropyLoss())
            model.train_on_batch(x, y)
            errors[name] = None
        except plait.PlaitError as e:
            errors[name] = (type(e).__name__, str(e))
    # the planner's partition keeps the region together (Config() would plan pp and dp too)
    model = plait.Model(Reuse(), plait.Config(num_stages=2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss=nn.CrossEntropyLoss())
    model.train_on_batch(x, y)
    errors["auto"] = model.plan.layers_per_stage
    return errors


@pytest.mark.timeout(120)
def test_user_errors_on_two_ranks():
    for errors in run_ranks(2, user_errors, timeout=110):
        kind, message = errors["sum"]
        assert kind == "PartitionError" and "sums to 4" in message and "11 layers" in message
        assert "0:0, 1:1, 2:2" in message  # the layers are listed
        kind, message = errors["world"]
        assert kind == "ConfigError" and "3 pipeline stages" in message and "world size is 2" in message
        assert "plait run -n 3" in message
        kind, message = errors["region"]
        assert kind == "PartitionError" and "a, b, a#1" in message
        kind, message = errors["stages"]
        assert kind == "PartitionError" and "only 1 layers" in message
        assert errors["auto"] == (3, 1)


def test_a_batch_size_of_zero_or_an_empty_x_is_an_error_in_fit_evaluate_and_predict():
    net = mlp()
    model = plait.Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=nn.CrossEntropyLoss())
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    calls = {"fit": lambda b, xs: model.fit(xs, y[: len(xs)], batch_size=b, verbose=0),
             "evaluate": lambda b, xs: model.evaluate(xs, y[: len(xs)], batch_size=b),
             "predict": lambda b, xs: model.predict(xs, batch_size=b)}
    for name, call in calls.items():
        with pytest.raises(plait.ConfigError, match="batch_size must be a positive integer.*got 0"):
            call(0, x)  # 0 used to mean "the whole set" silently
        with pytest.raises(plait.ConfigError, match="x has 0 rows"):
            call(None, x[:0])
    assert model.step == 0


class _SchedulerAtStart(Callback):
    """A learning-rate scheduler made when training begins, as users write it."""

    def __init__(self, model: plait.Model) -> None:
        self.model, self.scheduler = model, None

    def on_epoch_begin(self, epoch, logs=None):
        if self.scheduler is None:
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.model.optimizer, step_size=1, gamma=0.5)

    def on_epoch_end(self, epoch, logs=None):
        self.scheduler.step()


@pytest.mark.timeout(30)
def test_the_optimizer_exists_before_the_first_step_so_a_callback_can_make_a_scheduler():
    """model.optimizer was None until the first step: StepLR(None) failed in on_epoch_begin."""
    x, y = data()
    model = plait.Model(mlp(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    assert model.optimizer is None  # nothing to make it over before the model sees data
    callback = _SchedulerAtStart(model)
    model.fit(x, y, epochs=2, batch_size=12, verbose=0, callbacks=[callback])
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # halved after each epoch
    built = plait.Model(mlp(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    built.build(x[:4])
    assert isinstance(built.optimizer, torch.optim.SGD) and built.step == 0


@pytest.mark.timeout(60)
def test_a_resumed_fit_says_from_which_step_and_that_nothing_is_left(tmp_path, capsys):
    """A second run of a finished job returned its old history silently, as if it had trained."""
    x, y = data()

    def run(epochs):
        torch.manual_seed(0)
        model = plait.Model(mlp(), plait.Config(checkpoint_dir=tmp_path / "ckpt"),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
        history = model.fit(x, y, epochs=epochs, batch_size=12, verbose=1)
        return history, model

    first, _ = run(2)
    assert "resumed" not in capsys.readouterr().err
    again, model = run(2)
    said = capsys.readouterr().err
    assert f"plait: resumed from step 4 of {tmp_path / 'ckpt' / 'step-000004'}" in said, said
    assert "nothing is left to do: the 2 epochs asked for are done" in said, said
    assert again.history == first.history and model.step == 4
    more, model = run(3)
    said = capsys.readouterr().err
    assert "resumed from step 4" in said and "going on at epoch 3 of 3, batch 1" in said, said
    assert len(more.history["loss"]) == 3 and model.step == 6
