"""Stages of different data-parallel widths (Config.stage_dp, Alpa's cross-mesh resharding along
the batch) train exactly as one process: 3 ranks, stage 0 as 2 replicas (each running half the
rows of every micro-batch) and stage 1 on one rank, and the reverse, on Hugging Face GPT-2 and
Llama (tied word embedding and head: its gradient summed over every replica of both stages), with
1F1B, GPipe and ZB-H1, SGD with momentum and Adam, and ZeRO-2 over the replicas; and as Config()
plans them, where the planner predicts them faster (a small model priced so that they must be).

Each rank trains plait and a deep copy in one process through the same steps and compares the
loss of each step, every parameter and gradient it holds, the gathered `state_dict()` and
`predict` (`tests.test_tensor_parallel.train_and_compare`; fp32, atol 2e-5). Steps of 8, 4 and 4
rows at 2 micro-batches: every micro-batch's rows divide by 2. What stages of different dp refuse
raises a ConfigError naming the field and the fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait.errors import ConfigError
from plait.tensor_parts import shard_of
from tests.harness import run_ranks
from tests.test_tensor_parallel import train_and_compare

Run = tuple[str, dict[str, Any], bool]  # model, Config settings, Adam (else SGD with momentum)

STEPS = (8, 4, 4)  # rows of each step (of the case's 16): micro-batches of 4/4, 2/2, 2/2
EVEN = {"num_microbatches": 2}

JOINING: list[Run] = [  # stage 0 as 2 replicas, stage 1 on one rank: the rows join at the boundary
    ("gpt2", {"stage_dp": (2, 1), "layers_per_stage": (12, 11), **EVEN}, False),  # between blocks, 1F1B
    ("llama", {"stage_dp": (2, 1), "layers_per_stage": (10, 14), "schedule": "gpipe", **EVEN}, True),
    ("gpt2", {"stage_dp": (2, 1), "layers_per_stage": (9, 14), "schedule": "zbh1", **EVEN}, True),  # after the GELU
    ("gpt2", {"stage_dp": (2, 1), "layers_per_stage": (12, 11), "zero": 2, **EVEN}, True),  # stage 0's state sharded
]
SPLITTING: list[Run] = [  # stage 0 on one rank, stage 1 as 2 replicas: the rows split at the boundary
    ("gpt2", {"stage_dp": (1, 2), "layers_per_stage": (9, 14), "schedule": "gpipe", **EVEN}, True),
    ("llama", {"stage_dp": (1, 2), "layers_per_stage": (10, 14), **EVEN}, False),
]


def _train(rank: int, world: int, runs: list[Run]) -> list[tuple[list[str], int, str]]:
    return [train_and_compare(name, config, adam, split_loss=False, batches=STEPS) for name, config, adam in runs]


def _check(runs: list[Run], report: list[Any]) -> None:
    for rank, results in enumerate(report):
        for (name, config, adam), (problems, split, plan) in zip(runs, results):
            what = f"rank {rank} {name} {config} {'Adam' if adam else 'SGD'}"
            assert not problems, f"{what}:\n" + "\n".join(problems)
            assert split == 0, what  # nothing is split by tensor parallelism
            assert f"x dp={list(config['stage_dp'])} (per stage) on 3 rank(s)" in plan, what


@pytest.mark.timeout(280)
def test_two_replicas_joining_into_one_equal_one_process() -> None:
    _check(JOINING, run_ranks(3, _train, JOINING, timeout=270))


@pytest.mark.timeout(280)
def test_one_rank_splitting_into_two_replicas_equals_one_process() -> None:
    _check(SPLITTING, run_ranks(3, _train, SPLITTING, timeout=270))


class _SharedBias(nn.Module):
    """A value computed from parameters alone (not batch-major, requires grad) crosses the cut beside the
    batch's activations: layers b, a | c, the bias made on stage 0 and added on stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.source = nn.Parameter(torch.randn(1, 16))
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.b(self.source)  # (1, 4): one row whatever the batch
        return self.c(torch.relu(self.a(x))) + bias  # (B, 4)


def _two_steps(model: plait.Model, net: nn.Module, ref: nn.Module, ref_opt: torch.optim.Optimizer,
               rows: int = 4, outputs: int = 4) -> list[str]:
    """Two steps of `rows` rows (8 in, `outputs` out, MSE) on `model` (training `net`) and on `ref`
    (its deep copy): what differs in the loss, then in every parameter and gradient this rank holds
    (its part of one split by tensor parallelism)."""
    g = torch.Generator().manual_seed(1)
    problems = []
    for step in range(2):
        x, y = torch.randn(rows, 8, generator=g), torch.randn(rows, outputs, generator=g)
        got = model.train_on_batch(x, y)
        ref_opt.zero_grad()
        want = nn.functional.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        if abs(got - want.item()) > 1e-5 * abs(want.item()) + 1e-6:
            problems.append(f"loss of step {step}: {got} != {want.item()}")
    theirs = dict(ref.named_parameters())
    for name, p in net.named_parameters():
        if not p.is_meta:
            for what, mine, want_t in (("parameter", p.detach(), theirs[name].detach()),
                                       ("gradient", p.grad, theirs[name].grad)):
                cut = shard_of(p)
                if cut is not None and want_t is not None:
                    want_t = cut.part(want_t)
                if mine is not None and not torch.allclose(mine, want_t, rtol=1e-5, atol=1e-6):
                    problems.append(f"{what} {name}: {mine.flatten()[:4].tolist()} != {want_t.flatten()[:4].tolist()}")
    return problems


def _shared_bias(rank: int, world: int, widths: tuple[int, int]) -> list[str]:
    """Micro-batches of 2 rows: a replica of stage 0 runs 1 row, as many as the bias has; the capture
    tells them apart, and the bias's gradient reaches stage 0 once (not once per replica)."""
    torch.manual_seed(0)
    net = _SharedBias()
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = plait.Model(net, plait.Config(layers_per_stage=(2, 1), stage_dp=widths, num_microbatches=2,
                                          timeout_s=60.0),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), loss=nn.MSELoss())
    return _two_steps(model, net, ref, ref_opt)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("widths", [(2, 1), (1, 2)])
def test_a_value_of_no_rows_crosses_whole_and_its_gradient_counts_once(widths: tuple[int, int]) -> None:
    for rank, problems in enumerate(run_ranks(3, _shared_bias, widths, timeout=110)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def _refusals(rank: int, world: int) -> dict[str, Any]:
    """A small MLP at stage_dp=(2, 1) trains; a micro-batch of odd rows is refused by name, on
    every rank, before any step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    model = plait.Model(net, plait.Config(layers_per_stage=(3, 2), stage_dp=(2, 1), num_microbatches=2,
                                          timeout_s=60.0),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=nn.MSELoss())
    loss = model.train_on_batch(torch.randn(4, 8), torch.randn(4, 4))
    found = []
    steps = model.step
    for call in (lambda: model.train_on_batch(torch.randn(6, 8), torch.randn(6, 4)),  # micro-batches of 3 rows
                 lambda: model.fit(torch.randn(10, 8), torch.randn(10, 4), batch_size=4, verbose=0)):  # last: 2 rows
        try:
            call()
        except ConfigError as e:
            found.append(str(e))
    fit_steps = model.step - steps  # steps taken by the refused calls: none
    after = model.train_on_batch(torch.randn(4, 8), torch.randn(4, 4))  # the refusals left it running
    return {"losses": [loss, after], "refused": found, "fit_steps": fit_steps}


def _small_models(rank: int, world: int, root: str) -> dict[str, Any]:
    """`_refusals`, then `_planned`: small models sharing one start of 3 ranks."""
    return {"refusals": _refusals(rank, world), "planned": _planned(rank, world, root)}


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return run_ranks(3, _small_models, str(tmp_path_factory.mktemp("dp_widths")), timeout=140)


@pytest.mark.timeout(150)
def test_what_stages_of_different_dp_refuse(small_models: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(r["refusals"] for r in small_models):
        assert all(x > 0 for x in result["losses"]), (rank, result)
        rows, last = result["refused"]
        assert "of 3 rows does not divide by dp=[2] of stage_dp=[2, 1]" in rows, (rank, rows)
        assert "num_microbatches x a multiple of 2" in rows, (rank, rows)
        # fit refuses an epoch whose last batch (2 rows: micro-batches of 1) cannot run, before its first step
        assert "this epoch has a batch of 2 rows; its micro-batch 0:1 of 1 rows does not divide" in last, (rank, last)
        assert "drop_last=True" in last and result["fit_steps"] == 0, (rank, last, result["fit_steps"])


@pytest.mark.parametrize("field, value", [
    ("tp", 2), ("stage_tp", (2, 1)), ("num_virtual_stages", 2), ("sequence_parallel", True),
    ("tp_plan", {"*.fc": "colwise"}), ("replan", True), ("plan", "plan.json"),
    ("dp", 2), ("grad_reduction", "sum"),
])
def test_config_refuses_what_stage_dp_does_not_run_with(field: str, value: Any) -> None:
    settings: dict[str, Any] = {"layers_per_stage": (2, 2), "stage_dp": (2, 1), field: value}
    if field == "num_virtual_stages":
        settings.update(layers_per_stage=(1, 1, 1, 1), schedule="interleaved")
    if field == "tp_plan":
        settings.update(tp=2)
    with pytest.raises(ConfigError, match=r"stage_dp=\[2, 1\].*" + field) as e:
        plait.Config(**settings)
    assert "leave those fields at their defaults" in str(e.value) or "stage_tp" in str(e.value)


def test_config_needs_one_stage_dp_of_the_cut_and_the_ranks_they_add_up_to() -> None:
    with pytest.raises(ConfigError, match=r"stage_dp=\[2, 1, 1\] gives 3 stages but the cut gives 2"):
        plait.Config(layers_per_stage=(2, 2), stage_dp=(2, 1, 1))
    with pytest.raises(ConfigError, match="stage_dp must list one positive dp"):
        plait.Config(layers_per_stage=(2, 2), stage_dp=(2, 0))
    config = plait.Config(layers_per_stage=(2, 2), stage_dp=[2, 1])
    assert config.stage_dp == (2, 1) and config.tp == 1 and plait.Config.from_json(config.to_json()) == config
    assert config.lanes(3) == 2
    with pytest.raises(ConfigError, match=r"stage_dp=\[2, 1\], 3 ranks in all, on world_size=4; .*: launch 3 ranks"):
        config.lanes(4)


def pin_measurements(costs: Any, rows: int, world: int) -> None:
    """In this rank's process (on every rank: the last use of it there), price the layers by
    `costs` measured on `rows` rows and the link as a quiet host's gloo loopback. Measured under a
    busy suite, the link's latency grew to 5 ms and a plan of more stages won over tp=2's
    all-reduces: the planner's choice is the test's only where both of its inputs are."""
    import plait.planner.autoplan as autoplan
    import plait.planner.layout as layout
    from plait.cost.network import Link, Network
    from plait.planner.profile import LayerProfile

    def priced(*args: Any, **kwargs: Any) -> LayerProfile:
        return LayerProfile(costs, rows, 1, 1, 0.0, "test")

    gloo = Link(5e-5, 2e9)
    autoplan.profile_sample = layout.profile_sample = priced
    layout.calibrate = lambda: Network(gloo, gloo, world, gloo, None, 3e-4)  # type: ignore[assignment]


def _planned(rank: int, world: int, root: str) -> dict[str, Any]:
    """Config() on 3 ranks, the layers priced as `tests.planner.test_widths._embedding_like` (a profile
    in place of the measured one, on every rank): the planner takes stages of dp (2, 1), which train
    as one process does (2 steps of 4 rows, SGD; loss, then every parameter and gradient held). Its
    checkpoint resumes in a fresh model: the same pipeline, taken from the checkpoint (no plan
    report: nothing was planned), and 2 more steps as one process. Its saved report replays it
    (Config(plan=...)), again as one process."""
    from tests.planner.test_widths import _embedding_like

    net, _, costs = _embedding_like()
    pin_measurements(costs, 4, world)
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    config = plait.Config(timeout_s=60.0, checkpoint_dir=root)
    model = plait.Model(net, config, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=nn.MSELoss())
    problems = _two_steps(model, net, ref, ref_opt)
    model.save()
    assert model.plan_report is not None
    model.plan_report.save(f"{root}/plan-{rank}.json")
    again = _embedding_like()[0]
    resumed = plait.Model(again, config, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=nn.MSELoss())
    step = resumed.load(root)
    problems += [f"resumed: {p}" for p in _two_steps(resumed, again, ref, ref_opt)]
    fresh, replayed_net = _embedding_like()[0], _embedding_like()[0]
    replayed = plait.Model(replayed_net, plait.Config(timeout_s=60.0, plan=f"{root}/plan-{rank}.json"),
                           optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=nn.MSELoss())
    problems += [f"replayed: {p}" for p in _two_steps(replayed, replayed_net, fresh,
                                                      torch.optim.SGD(fresh.parameters(), lr=0.1))]
    assert replayed.plan_report is not None
    return {"problems": problems, "plan": str(model.plan), "stage_dp": model.plan.stage_dp,
            "layers": model.plan.layers_per_stage, "step": step,
            "resumed": (resumed.plan.stage_dp, resumed.plan.layers_per_stage, resumed.plan_report is None),
            "replayed": (replayed.plan.stage_dp, replayed.plan.layers_per_stage, replayed.plan_report.source)}


@pytest.mark.timeout(150)
def test_config_plans_stages_of_different_dp_widths_that_equal_one_process(small_models: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(r["planned"] for r in small_models):
        assert not result["problems"], f"rank {rank}:\n" + "\n".join(result["problems"])
        assert (result["stage_dp"], result["layers"]) == ((2, 1), (1, 3)), (rank, result["plan"])
        assert result["step"] == 2 and result["resumed"] == ((2, 1), (1, 3), True), (rank, result)
        assert result["replayed"][:2] == ((2, 1), (1, 3)) and "plan file" in result["replayed"][2], (rank, result)
