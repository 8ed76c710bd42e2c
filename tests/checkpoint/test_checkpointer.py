"""Checkpoints through `fit` on 1 to 4 ranks: exact resume, any layout, plain state dicts, fallback.

The directory format and its commit protocol alone, in one process: tests/checkpoint/test_disk.py.

Exact resume is bitwise (CPU, same layout): a run stopped after step k and resumed by a fresh
set of processes ends with the same bits in every tensor, and the same History, as a run never
stopped, with shuffle=True, Adam and dropout. A checkpoint loads into another layout (2 stages
x 2 replicas -> 4 stages, -> 1 process) and training goes on equal within fp32 rounding.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import plait
from plait.checkpoint import parts as checkpoint
from plait.checkpoint import tensorfile
from tests.harness import run_ranks
from tests.launching import clean_env
from tests.models import mlp

ROOT = Path(__file__).resolve().parents[2]


def data(n=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(),
                         nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class Interrupt(Exception):
    pass


class StopAfter:
    """Raises after `step` global steps (a callback): the run ends like a crash, between steps."""

    def __init__(self, model, step):
        self.model, self.step = model, step

    def on_batch_end(self, step, logs):
        if self.model.step == self.step:
            raise Interrupt(self.step)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)  # eps: see tests/test_equivalence.py


def train(rank, world, root, dp, pp, epochs, stop_after=None, every=2, net_fn=dropout_mlp, shuffle=True):
    """fit with checkpoints in `root`; returns (stopped, final state dict, history, step)."""
    x, y = data()
    torch.manual_seed(0)
    net = net_fn()
    # The bitwise tests compare two fresh runs: with dropout, each stage draws from its rank's RNG,
    # so both must cut the same way; the planner's cut follows timings that vary run to run.
    layers = (5, 4) if world > 1 and pp == 2 and net_fn is dropout_mlp else None
    config = plait.Config(num_microbatches=3, dp=dp, num_stages=pp if world > 1 else None,
                          layers_per_stage=layers, checkpoint_dir=root, checkpoint_every=every)
    model = plait.Model(net, config, optimizer=adam, loss=nn.CrossEntropyLoss(), metrics=["accuracy"])
    callbacks = [StopAfter(model, stop_after)] if stop_after is not None else []
    try:
        history = model.fit(x, y, epochs=epochs, batch_size=5, shuffle=shuffle, verbose=0, callbacks=callbacks)
    except Interrupt:
        return True, model.state_dict(), None, model.step
    return False, model.state_dict(), history.history, model.step


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp, pp", [(1, 2), (2, 2)])
def test_a_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(tmp_path, dp, pp):
    world = dp * pp
    whole = run_ranks(world, train, str(tmp_path / "whole"), dp, pp, 3, timeout=75)
    root = str(tmp_path / "ckpt")
    stopped = run_ranks(world, train, root, dp, pp, 3, 7, timeout=75)  # 5 steps per epoch
    assert all(s[0] and s[3] == 7 for s in stopped)
    assert open(os.path.join(root, "latest")).read() == "step-000006\n"
    assert sorted(os.listdir(root)) == ["latest", "step-000004", "step-000006"]  # keep=2, pruned
    resumed = run_ranks(world, train, root, dp, pp, 3, timeout=75)
    for (_, state, history, step), (_, want, want_history, want_step) in zip(resumed, whole):
        assert (step, history) == (want_step, want_history) == (15, want_history)
        assert_bitwise(state, want)
    # the stopped run had really diverged from its start: the comparison is not vacuous
    assert not torch.equal(stopped[0][1]["0.weight"], whole[0][1]["0.weight"])


def test_one_process_resume_is_bitwise_and_a_finished_run_does_nothing_more(tmp_path):
    _, want, want_history, _ = train(0, 1, str(tmp_path / "whole"), 1, 1, 2)
    root = str(tmp_path / "ckpt")
    assert train(0, 1, root, 1, 1, 2, stop_after=3, every=1)[0]
    _, state, history, step = train(0, 1, root, 1, 1, 2, every=1)
    assert step == 10 and history == want_history
    assert_bitwise(state, want)
    _, again, history, step = train(0, 1, root, 1, 1, 2, every=1)  # resumes at the end: no step
    assert step == 10 and history == want_history
    assert_bitwise(again, want)


def test_resume_with_other_data_order_is_an_error(tmp_path):
    root = str(tmp_path / "ckpt")
    train(0, 1, root, 1, 1, 1)
    with pytest.raises(plait.CheckpointError, match=r"shuffle: saved True, now False.*same data, batch_size"):
        train(0, 1, root, 1, 1, 2, shuffle=False)


# -- any layout ----------------------------------------------------------------------------------


def continue_from(rank, world, root, dp, pp):
    """Resume `root` (saved by another layout) for a second epoch; return the state dict."""
    return train(rank, world, root, dp, pp, 2, net_fn=mlp)[1]


@pytest.mark.timeout(260)
def test_a_checkpoint_of_two_stages_by_two_replicas_continues_on_four_stages_and_one_process(tmp_path):
    want = train(0, 1, str(tmp_path / "whole"), 1, 1, 2, net_fn=mlp)[1]  # one process, never stopped
    root = tmp_path / "2x2"
    run_ranks(4, train, str(root), 2, 2, 1, None, 2, mlp, timeout=100)  # one epoch: 5 steps
    meta = json.loads((root / "step-000005" / "meta.json").read_text())
    assert meta["plan"]["dp"] == 2 and sum(meta["plan"]["layers_per_stage"]) == 11  # the planner cuts
    assert len(meta["plan"]["layers_per_stage"]) == 2
    assert {e["shard"] for e in meta["tensors"].values()} == {0, 1}  # replica 0 saves the tensors
    assert meta["data"]["epoch"] == 1 and meta["data"]["batch"] == 0
    for name, result in {
        "4 stages": run_ranks(4, continue_from, str(_copy(root, tmp_path / "a")), 1, 4, timeout=100)[0],
        "1 process": continue_from(0, 1, str(_copy(root, tmp_path / "b")), 1, 1),
    }.items():
        assert result.keys() == want.keys(), name
        for k in want:
            torch.testing.assert_close(result[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# -- plain state dicts ---------------------------------------------------------------------------


def load_plain(rank, world, path, use_file):
    torch.manual_seed(5)
    net = mlp()
    model = plait.Model(net, plait.Config(num_microbatches=2), optimizer=adam, loss=nn.CrossEntropyLoss())
    x, y = data()
    model.train_on_batch(x, y)  # the pipeline is built: loading must reach every stage
    if use_file:
        model.load(path)
    else:
        model.load_state_dict(torch.load(path, weights_only=True))
    return model.state_dict(), model.predict(x)


@pytest.mark.timeout(300)
def test_export_gives_a_plain_file_that_net_and_a_parallel_run_load(tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(2, train, str(root), 1, 2, 1, None, 2, mlp, timeout=55)
    out = tmp_path / "model.pt"
    result = subprocess.run([sys.executable, "-m", "plait.cli", "export", str(root), "-o", str(out)],
                            cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "step 5" in result.stdout
    state = torch.load(out, weights_only=True)
    net = mlp()
    net.load_state_dict(state)  # plain torch accepts it
    x, _ = data()
    with torch.no_grad():
        want = net(x)
    safe = tmp_path / "model.safetensors"
    checkpoint.export(root, safe)
    for k, v in tensorfile.read_tensors(safe)[0].items():
        assert torch.equal(v, state[k])
    for use_file, path in ((False, out), (True, out), (True, safe)):
        for loaded, predicted in run_ranks(2, load_plain, str(path), use_file, timeout=55):
            assert_bitwise(loaded, state)
            torch.testing.assert_close(predicted, want)


def test_state_dict_of_a_tied_model_round_trips_through_a_checkpoint(tmp_path):
    from tests.models import make

    net, x, y, loss = make("gpt")
    model = plait.Model(net, optimizer=adam, loss=loss)
    model.train_on_batch(x, y)
    path = model.save(tmp_path / "ckpt")
    meta = json.loads((Path(path) / "meta.json").read_text())
    assert meta["aliases"] == {"lm_head.weight": "wte.weight"}
    checkpoint.export(tmp_path / "ckpt", tmp_path / "gpt.pt")
    state = torch.load(tmp_path / "gpt.pt", weights_only=True)
    assert list(state) == list(net.state_dict())
    fresh, _, _, _ = make("gpt", seed=3)
    fresh.load_state_dict(state)
    assert_bitwise(fresh.state_dict(), model.state_dict())


def test_keys_or_shapes_that_do_not_fit_are_listed(tmp_path):
    x, y = data()
    model = plait.Model(mlp(), optimizer=adam, loss=nn.CrossEntropyLoss())
    model.train_on_batch(x, y)
    model.save(tmp_path / "ckpt")
    wider = plait.Model(mlp(width=12), optimizer=adam, loss=nn.CrossEntropyLoss())
    with pytest.raises(plait.CheckpointError, match=r"shape mismatch \(11\): 0.weight: model \[12, 8\], "
                                                    r"saved \[16, 8\], 0.bias"):
        wider.load(tmp_path / "ckpt")
    deeper = plait.Model(mlp(depth=7), optimizer=adam, loss=nn.CrossEntropyLoss())
    with pytest.raises(plait.CheckpointError, match=r"missing from checkpoint .* \(2\): 12.weight, 12.bias"):
        deeper.load(tmp_path / "ckpt")
    state = mlp().state_dict()
    state["extra"] = torch.zeros(1)
    del state["0.bias"]
    with pytest.raises(plait.CheckpointError, match=r"missing from the state dict \(1\): 0.bias; "
                                                    r"unexpected in the state dict \(1\): extra"):
        model.load_state_dict(state)


def test_fit_resumes_from_the_previous_checkpoint_when_the_latest_is_damaged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="plait")
    _, want, want_history, _ = train(0, 1, str(tmp_path / "whole"), 1, 1, 2)
    root = tmp_path / "ckpt"
    assert train(0, 1, str(root), 1, 1, 2, stop_after=7, every=1)[0]  # saved 1..6
    shard = root / "step-000006" / "rank0.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    model = plait.Model(mlp(), optimizer=adam, loss=nn.CrossEntropyLoss())
    with pytest.raises(plait.CheckpointError, match=r"step-000006.*(truncated|sha256)"):
        model.load(root / "step-000006")  # asked for by name: an error, no fallback
    _, state, history, step = train(0, 1, str(root), 1, 1, 2, every=1)
    assert "skipping checkpoint step-000006" in caplog.text and "resumed from" in caplog.text
    assert step == 10 and history == want_history
    assert_bitwise(state, want)
