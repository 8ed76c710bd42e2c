"""`plait plan --model` and `Config()` choose by one function (`plait.planner.choice`): on the same
profile, the same layout.

The story: `plait plan --model cnn.py:build --devices 2` predicted 56 ms a step for its choice (32
micro-batches, ZB-H1), which ran at 258 ms, twice the 128 ms of what `Config(num_stages=2)` chose.
The command priced messages with the "cpu" preset's link (50 us) where a job measures its gloo
link (milliseconds, and the ranks' own time a hand-over), hid the gradient sum behind the backward
pass (gloo's is not), and left stages of different widths out of its choice. Here both run on one
priced profile and one measured-like network, with no processes: the command's `config` is
exactly the fields `Config()` plans on the same world.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import plait
import plait.planner.autoplan as autoplan
import plait.planner.calibrate as calibrate
import plait.planner.layout as layout
from plait.capture.trace import capture_batch
from plait.cli.plan_command import _plan
from plait.cost.network import Link, Network
from plait.plan.layer_costs import LayerCosts
from plait.planner.profile import LayerProfile

ROWS = 32
GLOO = Network(Link(2e-3, 1.3e9), Link(2e-3, 1.3e9), 2, Link(0.0, 7.5e8), None, 1e-3)  # as 2 gloo ranks measured


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 16), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


MODELS = {"cnn": (_cnn, (ROWS, 1, 8, 8)), "mlp": (_mlp, (ROWS, 16))}


def _priced(names: tuple[str, ...], heavy: float) -> LayerProfile:
    """Every layer `heavy` seconds a row forward (twice that backward), 1 ms fixed, 40 KB sent a
    row, 4 MB of gradients: a model whose micro-batches cost a hand-over each."""
    n = len(names)
    zeros, fixed = (0.0,) * n, (1e-3,) * n
    row = tuple(heavy * (1 + i % 3) for i in range(n))
    costs = LayerCosts(names, fixed, row, fixed, tuple(2 * r for r in row), zeros, zeros, (4e3,) * n, (4e4,) * n,
                       (4e6,) * n, (4e6,) * n, (1e-4,) * n, input_row_bytes=1e3, source="priced for the test")
    return LayerProfile(costs, ROWS, 1, 1, 0.0, "test")


def _args(model_file: str, shape: tuple[int, ...], devices: int) -> argparse.Namespace:
    return argparse.Namespace(gpt=None, model=model_file, devices=devices, batch=None, device=None, memory_gb=None,
                              sample_shape=shape, sample_dtype="float32", optimizer="adam", schedules=None, pp=None,
                              tp=None, microbatches=None, recompute=(False, True), zero=None, layout=None, top=5,
                              json=True, output=None, precision="fp32", offload=True)


@pytest.mark.parametrize("name, devices, heavy", [("cnn", 2, 2e-4), ("cnn", 4, 1e-4), ("mlp", 2, 5e-5),
                                                  ("mlp", 3, 1e-4), ("mlp", 4, 2e-4)])
def test_the_command_and_config_choose_the_same_layout_on_the_same_profile(
        monkeypatch: Any, tmp_path: Any, name: str, devices: int, heavy: float) -> None:
    build, shape = MODELS[name]
    model_file = tmp_path / f"{name}.py"
    model_file.write_text(f"from tests.planner.test_choice import _{name} as build\n")
    torch.manual_seed(0)
    net, x = build(), torch.randn(shape)
    captured = capture_batch(net, x)
    profile = _priced(tuple(captured.layers.layer_names), heavy)
    monkeypatch.setattr(autoplan, "profile_sample", lambda *a, **k: profile)
    monkeypatch.setattr(calibrate, "measure_here", lambda local_ranks: GLOO, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gloo = SimpleNamespace(is_initialized=lambda: True, get_backend=lambda: "gloo")  # a job's rank 0, on gloo
    monkeypatch.setattr(layout, "dist", gloo)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # every rank on this host, as the command assumes

    data, _ = _plan(_args(f"{model_file}:build", shape, devices))
    work = layout.Workload(net, captured, x, optimizer=torch.optim.Adam)
    planned = layout._decide(work, plait.Config(), devices, None, GLOO)

    command = data.get("chosen")
    assert command == planned["fields"], (command, planned["fields"])
    if "stage_tp" not in command and "stage_dp" not in command:  # a uniform layout: the same prediction
        assert data["predicted_step_time_s"] == pytest.approx(planned["report"]["predicted_step_time_s"])


def test_zero3_searches_every_schedule_and_batched_weight_gradients() -> None:
    """Config(zero=3): ZeRO-3 alone, with or without recomputation, every schedule (a split backward
    too: ZB-H1), with or without batched weight gradients."""
    from plait.planner.choice import search_space
    from plait.schedule.registry import schedule_spec

    space, source = search_space(plait.Config(zero=3), 4, 16)
    assert source == "planned" and space.zero == (3,) and space.recompute == (False, True)
    assert space.batch_weight_grads == (False, True) and "interleaved" in space.schedules
    assert any(schedule_spec(s).splits_backward for s in space.schedules)
    default = search_space(plait.Config(), 4, 16)[0]
    assert default.zero is None and default.zero3  # the default search tries 0-3 (the lowest that fits)
    assert not search_space(plait.Config(replan=True), 4, 16)[0].zero3  # zero=3 does not replan yet


def test_a_compiled_run_is_planned_without_zero3_or_batched_weight_gradients() -> None:
    """Config(compile=...) runs neither (`plait.config.settings.check_compile`): the search leaves
    them out, planned or partitioned."""
    from plait.planner.choice import search_space

    planned, source = search_space(plait.Config(compile=True), 4, 16)
    assert source == "planned" and not planned.zero3 and planned.batch_weight_grads == (False,)
    given = search_space(plait.Config(compile="aot_eager", num_stages=2, dp=2, num_microbatches=4), 4, 16)[0]
    assert not given.zero3 and given.batch_weight_grads == (False,)


def test_offload_is_searched_for_ranks_beside_a_host_unless_the_config_says() -> None:
    """Config.offload None: searched (taken where only it fits) on ranks with a host link (GPU
    presets), not on CPU ranks; "optimizer": always; False: never."""
    from plait.planner.choice import search_inputs

    def space(config: plait.Config, host: tuple[float, float]) -> tuple[bool, ...]:
        inputs = search_inputs(config, 2, 8, 2, 2.0, GLOO, "nccl", host)
        assert (inputs.cluster.host_link, inputs.cluster.host_bandwidth) == host
        return inputs.space.offload

    gpu = (31.5e9, 51.2e9)
    assert space(plait.Config(), gpu) == (False, True) and space(plait.Config(), (0.0, 0.0)) == (False,)
    assert space(plait.Config(offload=False), gpu) == (False,)
    assert space(plait.Config(zero=3, offload="optimizer"), (0.0, 0.0)) == (True,)  # a no-op on CPU ranks
