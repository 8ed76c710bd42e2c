"""Stages of different tp widths (Config.stage_tp, Alpa's cross-mesh resharding) train exactly
as one process: 3 ranks, stage 0 at tp=2 and stage 1 at tp=1, and the reverse, on Hugging Face
GPT-2 and Llama (tied word embedding and head: kept whole on both stages, its gradient summed
once), with 1F1B, GPipe and ZB-H1, and recomputed; cut between blocks and inside one.

Each rank trains plait and a deep copy in one process through the same steps and compares the
loss of each step, its part of every parameter and gradient, the gathered `state_dict()` and
`predict` (`tests.test_tensor_parallel.train_and_compare`; fp32, atol 2e-5). Their checkpoints:
`tests.test_cross_mesh_checkpoint`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import plait
from tests.harness import run_ranks
from tests.test_tensor_parallel import train_and_compare

Run = tuple[str, dict[str, Any], bool]  # model, Config settings, Adam (else SGD with momentum)

RUNS: list[Run] = [
    ("gpt2", {"stage_tp": (2, 1), "layers_per_stage": (12, 11)}, False),  # between blocks, 1F1B
    ("gpt2", {"stage_tp": (1, 2), "layers_per_stage": (9, 14), "schedule": "gpipe"}, True),  # after the GELU
    ("llama", {"stage_tp": (2, 1), "layers_per_stage": (10, 14), "schedule": "gpipe"}, True),
    ("llama", {"stage_tp": (1, 2), "layers_per_stage": (10, 14)}, False),
    ("gpt2", {"stage_tp": (2, 1), "layers_per_stage": (12, 11), "schedule": "zbh1", "batch_weight_grads": True},
     True),
    ("gpt2", {"stage_tp": (2, 1), "layers_per_stage": (12, 11), "recompute": True}, True),  # as the planner may choose
]


def _three_ranks(rank: int, world: int, runs: list[Run]) -> list[tuple[list[str], int, str]]:
    return [train_and_compare(name, config, adam, split_loss=False) for name, config, adam in runs]


@pytest.mark.timeout(600)
def test_stages_of_tp_2_and_1_and_of_1_and_2_equal_one_process() -> None:
    report = run_ranks(3, _three_ranks, RUNS, timeout=580)
    for rank, results in enumerate(report):
        for (name, config, adam), (problems, split, plan) in zip(RUNS, results):
            what = f"rank {rank} {name} {config} {'Adam' if adam else 'SGD'}"
            assert not problems, f"{what}:\n" + "\n".join(problems)
            widths = config["stage_tp"]
            assert f"x tp={list(widths)} (per stage, crossing as tiles) on 3 rank(s)" in plan, what
            alone = rank == 2 if widths == (2, 1) else rank == 0  # the rank of the tp=1 stage splits nothing
            assert split == 0 if alone else split >= 4, (what, split)


def _four_ranks(rank: int, world: int) -> tuple[list[str], int, str]:
    return train_and_compare("gpt2", {"stage_tp": (1, 2, 1), "layers_per_stage": (8, 8, 7), "crossing": "whole"},
                             True, split_loss=False)


@pytest.mark.timeout(300)
def test_a_wide_stage_between_two_narrow_ones_equals_one_process() -> None:
    """stage_tp=(1, 2, 1) on 4 ranks: the middle stage receives and sends across a change of
    width; the word embedding and head (stages 0 and 2, one rank each) sum their gradient alone.
    Values cross whole (crossing="whole"): rank 0 sends its output to both ranks of stage 1, rank 3
    its gradient to both, and nothing is all-gathered."""
    for rank, (problems, split, plan) in enumerate(run_ranks(4, _four_ranks, timeout=280)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
        assert split == (6 if rank in (1, 2) else 0), (rank, split)
        assert "x tp=[1, 2, 1] (per stage, crossing as whole) on 4 rank(s)" in plan


@pytest.mark.parametrize("field", ["stage_tp", "stage_dp"])
def test_one_process_runs_every_layer_on_one_stage(field: str) -> None:
    """Without a launcher the widths (tp or replicas), like the cut, are set aside (a warning), and
    the model trains."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = plait.Model(net, plait.Config(layers_per_stage=(2, 1), **{field: (2, 1)}),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=nn.MSELoss())
    assert model.train_on_batch(torch.randn(4, 8), torch.randn(4, 4)) > 0
    assert model.plan.stage_tp == () == model.plan.stage_dp and model.plan.world_size == 1


SIX: list[Run] = [  # two replicas of the whole pipeline: ranks 0 1 | 2 and 3 4 | 5 (or 0 | 1 2 and 3 | 4 5)
    ("gpt2", {"stage_tp": (2, 1), "layers_per_stage": (12, 11), "dp": 2}, False),
    ("llama", {"stage_tp": (1, 2), "layers_per_stage": (10, 14), "dp": 2, "schedule": "gpipe",
               "crossing": "whole"}, True),
    ("gpt2", {"stage_tp": (2, 1), "layers_per_stage": (12, 11), "dp": 2, "zero": 1}, True),
    ("gpt2", {"stage_tp": (1, 2), "layers_per_stage": (9, 14), "dp": 2, "zero": 2, "schedule": "zbh1",
              "batch_weight_grads": True}, True),
]


def _planned_copies(rank: int, world: int) -> dict[str, Any]:
    """Config() on 6 ranks, the layers and link priced in place of measured (`pin_measurements`,
    on every rank): a pair of linears that tp=2 splits and a LayerNorm it does not, 0.01 s a row each, the
    linears' gradients 10 MB. Two copies of the pipeline (pair at tp=2 | LayerNorm) are predicted
    fastest: each copy runs 4 of the 8 rows, the LayerNorm no rank computes twice, and each
    gradient is summed over 2 ranks at half its size. It trains as one process does."""
    import copy

    from plait.plan.layer_costs import LayerCosts
    from tests.test_cross_mesh_dp import _two_steps, pin_measurements

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8), nn.LayerNorm(8))
    row, zeros, grads = (1e-2, 1e-6, 1e-2, 1e-2), (0.0,) * 4, (1e7, 0.0, 1e7, 0.0)
    costs = LayerCosts(("0", "1", "2", "3"), zeros, row, zeros, tuple(2 * r for r in row), zeros, zeros,
                       (64.0,) * 4, (32.0,) * 4, grads, grads, zeros, input_row_bytes=32.0)
    pin_measurements(costs, 8, world)
    ref = copy.deepcopy(net)
    model = plait.Model(net, plait.Config(timeout_s=60.0), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                        loss=nn.MSELoss())
    problems = _two_steps(model, net, ref, torch.optim.SGD(ref.parameters(), lr=0.1), rows=8, outputs=8)
    return {"problems": problems, "plan": str(model.plan),
            "layout": (model.plan.stage_tp, model.plan.dp, model.plan.layers_per_stage)}


def _six_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests.test_tensor_parallel import _save_and_resume

    saved = {"stage_tp": (2, 1), "layers_per_stage": (12, 11), "dp": 2, "zero": 1}
    return {"runs": [train_and_compare(name, config, adam, split_loss=False) for name, config, adam in SIX],
            "resumed": _save_and_resume(rank, world, root, saved, {"layers_per_stage": (8, 8, 7), "dp": 2},
                                        {"stage_tp": (1, 2), "layers_per_stage": (9, 14), "dp": 2}),
            "planned": _planned_copies(rank, world)}


@pytest.mark.timeout(400)
def test_replicas_of_a_pipeline_of_stages_of_different_widths_equal_one_process(tmp_path: Any) -> None:
    """dp=2 copies of a pipeline of tp widths (2, 1) or (1, 2) on 6 ranks: each stage's ranks
    all-reduce their gradients with the other copy's, the tied embedding and head is summed over
    all of its ranks, and ZeRO shards each stage's state over the two copies; a checkpoint of it
    (ZeRO-1) resumes in 3 stages x dp=2, its export loads into the other widths; and as Config()
    plans it where it is predicted fastest (`_planned_copies`)."""
    report = run_ranks(6, _six_ranks, str(tmp_path), timeout=380)
    for rank, results in enumerate(report):
        for (name, config, adam), (problems, split, plan) in zip(SIX, results["runs"]):
            what = f"rank {rank} {name} {config} {'Adam' if adam else 'SGD'}"
            assert not problems, f"{what}:\n" + "\n".join(problems)
            widths = config["stage_tp"]
            assert f"x 2 replica(s) x tp={list(widths)}" in plan and "on 6 rank(s)" in plan, what
            assert ("ZeRO-" in plan) == ("zero" in config), what
            alone = rank % 3 == (2 if widths == (2, 1) else 0)  # the rank of a tp=1 stage splits nothing
            assert split == 0 if alone else split >= 4, (what, split)
        assert not results["resumed"], f"rank {rank}:\n" + "\n".join(results["resumed"])
        planned = results["planned"]
        assert not planned["problems"], f"rank {rank}:\n" + "\n".join(planned["problems"])
        assert planned["layout"] == ((2, 1), 2, (3, 1)), (rank, planned["plan"])
