"""Every common Hugging Face architecture splits and trains equal to one process, by the path users take.

Each architecture (`tests/architectures.py`: decoder-only LMs, masked LMs, encoder-decoders, a
vision transformer, mixtures of experts; tiny random configs, nothing downloaded) trains 3 SGD
steps with momentum with plait and, on the side, a deep copy in one process
(`tests/architecture_runs.py`: each step's loss, the full `state_dict` after the steps, atol 2e-5,
and `predict`'s logits). The runs:

- every architecture through `Config(num_stages=2)`: the planner profiles the model and cuts it,
  with the latest transformers and, in a child process, a 4.x release (`dev.py` installs it);
- every architecture of at most `EVERY_LAYER_MAX` layers cut after every layer where a cut may
  fall: 2 ranks, each holding every other layer as an interleaved chunk, so every boundary is
  crossed over the wire (the strictest cut);
- a subset through `Config(num_stages=3)`, `Config(num_stages=2, dp=2)` and `Config(tp=2)`.

docs/architectures.md holds the table these tests back. In one process, each architecture also
trains recomputed layer by layer, bit for bit as with its activations kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import plait
from tests.architecture_runs import EVERY_LAYER, train_all, train_and_compare
from tests.harness import run_ranks

pytest.importorskip("transformers")
from tests.architectures import ARCHITECTURES, make  # noqa: E402 - after the importorskip

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMERS_4 = os.environ.get("PLAIT_TRANSFORMERS_4", str(ROOT / ".venv" / "transformers-4"))
EVERY_LAYER_MAX = 32  # captured layers; above, a cut after every layer costs more than it adds
THREE_STAGES = ["gpt2", "llama", "bert", "t5"]
TWO_BY_TWO = ["gpt2", "albert", "bart"]
TENSOR_PARALLEL = ["gpt2", "llama", "bert"]


def check(report: list[dict[str, Any]], name: str, num_stages: int, dp: int, tp: int = 1) -> None:
    problems = [f"rank {r}: {p}" for r, ranks in enumerate(report) for p in ranks[name]["problems"]]
    assert not problems, f"{name}:\n" + "\n".join(problems)
    for ranks in report:
        got = ranks[name]
        assert (got["num_stages"], got["dp"], got["tp"]) == (num_stages, dp, tp), got


@pytest.fixture(scope="module")
def two_stages() -> list[dict[str, Any]]:
    """Every architecture on 2 ranks in one job: importing torch and transformers per rank costs more than a model."""
    return run_ranks(2, train_all, ARCHITECTURES, {"num_stages": 2}, timeout=1500)


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.timeout(1560)  # the first test also waits for the shared 2-rank run
def test_two_stages_planned(two_stages: list[dict[str, Any]], name: str) -> None:
    check(two_stages, name, 2, 1)
    assert sum(two_stages[0][name]["cut"]) > 1  # the planner's cut: both stages hold layers


@pytest.fixture(scope="module")
def two_stages_transformers_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same planned 2-stage runs under transformers 4.x, in a child process whose path puts
    that release first (the suite's own process has imported the latest)."""
    if not Path(TRANSFORMERS_4, "transformers").is_dir():
        pytest.skip(f"no transformers 4.x in {TRANSFORMERS_4}: `python3 dev.py test` installs it")
    out = tmp_path_factory.mktemp("transformers-4") / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TRANSFORMERS_4, str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "tests.architecture_runs", "--ranks", "2", "--out", str(out),
                           "--fields", json.dumps({"num_stages": 2}), "--names", *ARCHITECTURES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1560)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.timeout(1620)
def test_two_stages_planned_transformers_4(two_stages_transformers_4: dict[str, Any], name: str) -> None:
    assert two_stages_transformers_4["transformers"].startswith("4."), two_stages_transformers_4["transformers"]
    check(two_stages_transformers_4["ranks"], name, 2, 1)


def _layer_counts() -> dict[str, int]:
    from plait.capture.trace import capture_batch

    counts = {}
    for name in ARCHITECTURES:
        arch = make(name)
        counts[name] = len(capture_batch(arch.net, arch.x).layers.layer_names)
    return counts


@pytest.fixture(scope="module")
def every_layer() -> tuple[list[str], list[dict[str, Any]]]:
    names = [n for n, count in _layer_counts().items() if count <= EVERY_LAYER_MAX]
    return names, run_ranks(2, train_all, names, {"layers_per_stage": EVERY_LAYER}, timeout=1200)


@pytest.mark.timeout(1260)
def test_cut_after_every_layer(every_layer: tuple[list[str], list[dict[str, Any]]]) -> None:
    names, report = every_layer
    assert len(names) >= 10, names  # most architectures are small enough
    for name in names:
        check(report, name, 2, 1)
        cut = report[0][name]["cut"]  # chunks of one layer, but for uncuttable regions
        assert report[0][name]["num_chunks"] == len(cut) >= sum(cut) // 2, (name, cut)


@pytest.mark.timeout(600)
def test_three_stages_planned() -> None:
    report = run_ranks(3, train_all, THREE_STAGES, {"num_stages": 3}, timeout=560)
    for name in THREE_STAGES:
        check(report, name, 3, 1)


@pytest.mark.timeout(600)
def test_two_stages_two_replicas_planned() -> None:
    report = run_ranks(4, train_all, TWO_BY_TWO, {"num_stages": 2, "dp": 2}, timeout=560)
    for name in TWO_BY_TWO:
        check(report, name, 2, 2)


@pytest.mark.timeout(600)
def test_tensor_parallel_planned() -> None:
    report = run_ranks(2, train_all, TENSOR_PARALLEL, {"tp": 2}, timeout=560)
    for name in TENSOR_PARALLEL:
        check(report, name, 1, 1, tp=2)


def mixtral_experts_kept_whole(rank: int, world: int) -> dict[str, Any]:
    return {"mixtral": train_and_compare("mixtral", {"num_stages": 2}, leaf_modules=("MixtralSparseMoeBlock",))}


@pytest.mark.timeout(300)
def test_mixtral_with_its_experts_kept_whole_by_class_name() -> None:
    report = run_ranks(2, mixtral_experts_kept_whole, timeout=280)
    check(report, "mixtral", 2, 1)
    assert report[0]["mixtral"]["kept_whole"] == ["model.layers.0.mlp", "model.layers.1.mlp"]


def _sgd_twice(name: str, **recompute: Any) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    arch = make(name)
    model = plait.Model(arch.net, plait.Config(num_microbatches=2, schedule="gpipe", **recompute),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), loss=arch.loss)
    for _ in range(2):
        model.train_on_batch(arch.x, arch.y)
    return model.state_dict(), model.plan.recompute_by_layer


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.timeout(120)
def test_recomputed_layer_by_layer_trains_as_kept(name: str) -> None:
    """One process: each architecture's stage graph cut into its blocks' pieces, each recomputed
    in the backward, trains bit for bit as with every activation kept."""
    kept, _ = _sgd_twice(name)
    again, by_layer = _sgd_twice(name, recompute=True, recompute_by_layer=True)
    assert by_layer == (0,)
    for key, value in kept.items():
        assert torch.equal(again[key], value), key

