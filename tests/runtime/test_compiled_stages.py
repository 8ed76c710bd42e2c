"""Config(compile=...): each stage's graph through torch.compile trains as one process does.

Two ranks train Hugging Face GPT-2 (tests.test_real_models' tiny config) compiled, beside a deep
copy in one eager process, through the same 3 steps (Adam), and compare the loss of each step,
this rank's part of every parameter and gradient, the state dict and `predict`'s logits at fp32
rounding (rtol 1e-5, atol 2e-5: `tests.test_tensor_parallel.train_and_compare`). The backend
"aot_eager" (dynamo and AOTAutograd, no code generation) runs every schedule, the split backward,
recomputation whole and by layer, tp=2 (its collectives between graphs) and the planned layout;
one run goes through inductor, the default backend, generating C++ for this CPU. Each run must
have compiled graphs (dynamo's count of unique graphs grows), or compile did nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_ranks

pytest.importorskip("transformers")

RUNS: list[tuple[str, dict[str, Any]]] = [
    ("aot_eager", {"num_stages": 2, "schedule": "1f1b"}),
    ("aot_eager", {"num_stages": 2, "schedule": "zbh1"}),  # its W computed with its B
    ("aot_eager", {"num_stages": 2, "schedule": "interleaved", "num_virtual_stages": 2}),
    ("aot_eager", {"num_stages": 2, "schedule": "gpipe", "recompute": True}),
    ("aot_eager", {"num_stages": 2, "recompute": True, "recompute_by_layer": True}),
    ("aot_eager", {"num_stages": 1, "tp": 2}),
    ("aot_eager", {"num_microbatches": None, "schedule": None}),  # Config(compile=...) alone: planned
    ("inductor", {"num_stages": 2, "schedule": "1f1b"}),
]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiled_runs(rank: int, world: int) -> list[dict[str, Any]]:
    from tests.test_tensor_parallel import train_and_compare

    out = []
    for backend, config in RUNS:
        before = _graphs()
        problems, _, plan = train_and_compare("gpt2", {**config, "compile": backend}, adam=True, split_loss=False)
        out.append({"problems": problems, "plan": plan, "graphs": _graphs() - before})
        torch._dynamo.reset()  # the next run's stage graphs compile anew (the same code, other shapes)
    return out


@pytest.fixture(scope="module")
def compiled() -> list[list[dict[str, Any]]]:
    return run_ranks(2, _compiled_runs, timeout=560)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{b}-{'-'.join(f'{k}={v}' for k, v in c.items())}"
                                                         for b, c in RUNS])
def test_compiled_stages_train_as_one_process(compiled: list[list[dict[str, Any]]], index: int) -> None:
    backend, config = RUNS[index]
    for rank, runs in enumerate(compiled):
        run = runs[index]
        assert not run["problems"], f"rank {rank} {backend} {config}:\n" + "\n".join(run["problems"])
        assert run["graphs"] > 0, f"rank {rank} {backend} {config}: no graph compiled"
        if config.get("schedule", "") is None:  # planned: not ZeRO-3 nor batched weight gradients (compile runs neither)
            assert "ZeRO-3" not in run["plan"] and "batched" not in run["plan"], run["plan"]
