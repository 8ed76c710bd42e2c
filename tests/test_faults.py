"""Ranks really killed (SIGKILL, SIGTERM) at several points: every other rank ends in time naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import plait
from tests.harness import run_ranks
from tests.launching import clean_env
from tests.models import even_cut, mlp

TIMEOUT_S = 6.0  # 3 s fired spuriously in the first step of a 3-rank job under the full suite's load
# "Within timeout_s" of the kill, plus a margin for a busy machine: 4 ranks on 2 shared cores
# take seconds to be scheduled and to write their reports (+4 s held on an idle machine only).
ENOUGH_S = TIMEOUT_S + 25.0
LAYOUTS = {"2x2": (2, 2), "3 stages": (1, 3)}  # (dp, stages)


def data(n=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _kill_at(target, name, when, sig, stamp):
    """Make this process kill itself with `sig` in target.name on the call where when(count, args)."""
    original = getattr(target, name)
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if when(count[0], args):
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), sig)
            time.sleep(30)  # a signal is delivered asynchronously: never get past this point
        return original(*args, **kwargs)

    setattr(target, name, wrapper)


def _arm(where, sig, stamp):
    """Kill this rank at `where`, in step 7 of 10 (checkpoints every 2 steps: step 6 is the latest)."""
    from plait.checkpoint import disk as checkpoint
    from plait.runtime import executor
    from plait.runtime.dp import grad_sync

    target, name, when = {
        "forward": (executor.StageExecutor, "forward", lambda n, a: n == 2 * 6 + 2),  # 2 micro-batches a step
        "backward": (executor.StageExecutor, "backward", lambda n, a: n == 2 * 6 + 1),
        "allreduce": (grad_sync.GradientBuckets, "_launch", lambda n, a: n > 6 * len(a[0].buckets)),
        "save: shard": (checkpoint, "write_shard", lambda n, a: n == 4),  # the step 8 checkpoint
        "save: latest": (checkpoint, "write_atomic", lambda n, a: a[0].name == "latest" and n == 8),
    }[where]
    _kill_at(target, name, when, sig, stamp)


def fit(rank, world, root, dp, pp, victim=None, where=None, sig=None, stamp=None):
    """fit 2 epochs (10 steps) with checkpoints every 2 steps; (end time, error text, state, history)."""
    x, y = data()
    torch.manual_seed(0)
    # The cut is given: the uninterrupted run and the resumed one must cut alike.
    config = plait.Config(num_microbatches=2, timeout_s=TIMEOUT_S, dp=dp, layers_per_stage=even_cut(11, pp),
                          bucket_cap_mb=1e-4, checkpoint_dir=root, checkpoint_every=2)
    model = plait.Model(mlp(), config, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-4),
                        loss=nn.CrossEntropyLoss())
    if rank == victim:
        _arm(where, sig, stamp)
    try:
        history = model.fit(x, y, epochs=2, batch_size=5, verbose=0)
    except plait.PlaitError as e:
        return time.time(), f"{type(e).__name__}: {e}", None, None
    return time.time(), None, model.state_dict(), history.history


_WHOLE = {}


def uninterrupted(tmp_path, layout):
    if layout not in _WHOLE:
        dp, pp = LAYOUTS[layout]
        _WHOLE[layout] = run_ranks(dp * pp, fit, str(tmp_path / "whole"), dp, pp, timeout=90)[0]
    return _WHOLE[layout]


CASES = [  # where, victim, signal, layout
    ("forward", 1, signal.SIGKILL, "3 stages"),
    ("backward", 3, signal.SIGKILL, "2x2"),
    ("backward", 0, signal.SIGTERM, "2x2"),  # rank 0 also hosts the job's store here
    ("allreduce", 2, signal.SIGTERM, "2x2"),
    ("save: shard", 1, signal.SIGKILL, "2x2"),
    ("save: latest", 0, signal.SIGKILL, "3 stages"),  # after step-000008 is renamed, before `latest`
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, victim, sig, layout", CASES, ids=[f"{c[0]}-rank{c[1]}-{c[2].name}" for c in CASES])
def test_a_killed_rank_is_named_in_time_and_a_rerun_resumes_to_the_same_result(tmp_path, where, victim, sig,
                                                                               layout):
    from plait.checkpoint import disk as checkpoint

    dp, pp = LAYOUTS[layout]
    root, stamp = tmp_path / "ckpt", str(tmp_path / "killed")
    results = run_ranks(dp * pp, fit, str(root), dp, pp, victim, where, sig, stamp, timeout=90, dying={victim})
    killed = float(open(stamp).read())
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        ended, error = result[:2]
        assert error is not None and error.startswith("PipelineError"), (rank, error)
        named = (f"no report from ranks [{victim}]" in error if victim != 0 else
                 "store is unreachable" in error and "rank 0" in error)  # rank 0 hosted the store
        assert named, (rank, error)
        assert ended - killed < ENOUGH_S, (rank, ended - killed, error)
        print(f"{where}: rank {rank} ended {ended - killed:.2f} s after rank {victim} was killed")

    # nothing partial is taken for complete: `latest` names a complete checkpoint, the one resumed
    assert (root / "latest").read_text() == "step-000006\n"
    assert checkpoint.find_resumable(root).step == 6
    leftovers = sorted(p.name for p in root.iterdir())
    if where == "save: shard":
        assert any(".tmp-" in name for name in leftovers), leftovers  # the unfinished step 8
    if where == "save: latest":
        assert "step-000008" in leftovers  # complete, but never published: not resumed

    _, error, state, history = run_ranks(dp * pp, fit, str(root), dp, pp, timeout=90)[0]
    _, _, want, want_history = uninterrupted(tmp_path, layout)
    assert error is None and history == want_history
    for k in want:
        assert torch.equal(state[k], want[k]), k
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000008", "step-000010"]


RESTART_SCRIPT = """
import json, os, signal, sys, time
import torch
from torch import nn
import plait
from plait.runtime import executor

out, root, kill = sys.argv[1], sys.argv[2], sys.argv[3:]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if kill and attempt == 0 and os.environ["RANK"] == kill[0]:
    backward, calls = executor.StageExecutor.backward, [0]
    def dying(*args, **kwargs):  # mid-step: in the backward pass of the 2nd micro-batch of step 6
        calls[0] += 1
        if calls[0] == 2 * 6:
            os.kill(os.getpid(), signal.SIGKILL)
        return backward(*args, **kwargs)
    executor.StageExecutor.backward = dying
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(23, 8, generator=g), torch.randint(0, 4, (23,), generator=g)
# The cut is given: runs compared bit for bit must cut alike (dropout follows the cut), and a
# planned cut follows timings that vary from run to run.
model = plait.Model(net, plait.Config(layers_per_stage=(3, 3), num_microbatches=2, checkpoint_dir=root,
                                      checkpoint_every=2, timeout_s=10),
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss=nn.CrossEntropyLoss())
history = model.fit(x, y, epochs=2, batch_size=5, verbose=0)
state = model.state_dict()
if model.rank == 0:
    torch.save(state, os.path.join(out, "final.pt"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"history": history.history, "step": model.step, "attempt": attempt}, f)
"""


def launch(tmp_path, name, options, kill=None):
    """`plait run OPTIONS train.py OUT CKPT [KILL_RANK]`; returns (completed process, OUT)."""
    script = tmp_path / "train.py"
    script.write_text(RESTART_SCRIPT)
    out = tmp_path / name
    out.mkdir()
    args = [str(out), str(tmp_path / f"{name}-ckpt")] + ([str(kill)] if kill is not None else [])
    result = subprocess.run([sys.executable, "-m", "plait.cli", "run", *options, str(script), *args],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180)
    return result, out


@pytest.mark.timeout(600)
def test_plait_run_names_the_killed_rank_and_restarts_resume_to_the_same_result(tmp_path):
    whole, whole_out = launch(tmp_path, "whole", ["-n", "2"])
    assert whole.returncode == 0, whole.stderr
    want = torch.load(whole_out / "final.pt", weights_only=True)
    want_result = json.loads((whole_out / "result.json").read_text())
    assert want_result["step"] == 10

    failed, _ = launch(tmp_path, "failed", ["-n", "2"], kill=1)
    assert failed.returncode != 0
    assert "rank 1 (local rank 1" in failed.stderr and "signal SIGKILL" in failed.stderr, failed.stderr[-3000:]

    restarted, out = launch(tmp_path, "restarted", ["-n", "2", "--max-restarts", "1"], kill=1)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["attempt"] == 1  # the job really was restarted
    assert result["history"] == want_result["history"] and result["step"] == 10
    state = torch.load(out / "final.pt", weights_only=True)
    for k in want:
        assert torch.equal(state[k], want[k]), k
