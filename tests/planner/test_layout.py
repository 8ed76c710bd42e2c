"""Planning a run from its Config: Config() plans everything, num_stages gets the optimal
partition, split_points cut where they name, plan files replay (or say what does not match), the
first steps are checked against the prediction, and a replan keeps training equal to one process."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.config.run_options import apply_run_options
from tests.harness import run_ranks
from tests.models import mlp


def data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def reference(net, x, y, steps, make_opt):
    """Single-process training of a copy: per-step losses, then the parameters."""
    opt = make_opt(net.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def train(rank, world, config, steps=5, make_opt=sgd):
    """Train a plait model and a single-process copy; return what the test compares."""
    x, y = data()
    torch.manual_seed(1)
    net = mlp()
    ref = copy.deepcopy(net)
    model = plait.Model(net, config, optimizer=make_opt, loss=nn.CrossEntropyLoss())
    losses = [model.train_on_batch(x, y) for _ in range(steps)]
    want = reference(ref, x, y, steps, make_opt)
    state = model.state_dict()
    diff = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items())
    out_diff = float((model.predict(x) - ref(x).detach()).abs().max())
    report = model.plan_report
    return {
        "losses": losses, "want": want, "diff": diff, "out_diff": out_diff,
        "plan": model.plan.to_json(), "report": report.to_json() if report else None,
        "feedback": report.feedback.summary() if report and report.feedback else None,
        "check": report.feedback.to_dict() if report and report.feedback else None,
        "profiles": len(plait.planner.profile._CACHE),
        "config_kept": model.config == apply_run_options(config),  # the user's: the layout lives in the plan
    }


def assert_equal_to_one_process(results):
    for r in results:
        assert r["losses"] == pytest.approx(r["want"], rel=1e-5, abs=1e-6)
        assert r["diff"] < 1e-5 and r["out_diff"] < 1e-5


@pytest.mark.timeout(180)
def test_config_with_no_sizes_plans_and_trains_like_one_process():
    results = run_ranks(2, train, plait.Config(), timeout=170)
    assert_equal_to_one_process(results)
    assert results[0]["plan"] == results[1]["plan"]  # one layout on every rank
    assert results[0]["report"] == results[1]["report"]
    assert results[0]["config_kept"] and results[1]["config_kept"]
    chosen = json.loads(results[0]["report"])
    assert chosen["pp"] * chosen["dp"] * chosen["tp"] == 2 and chosen["source"] == "planned"
    assert {c["tp"] for c in [chosen, *chosen["alternatives"]]} == {1, 2}  # Config() prices tp too
    assert results[1]["profiles"] == 1  # rank 1 profiled alongside rank 0, loading the host alike
    assert "(the slowest rank's)" in chosen["costs"]["source"]  # its rounds reduced over both ranks
    # the closed loop: steps 2..4 measured against the prediction, a number for every stage
    line = results[0]["feedback"]
    assert line.startswith("plait plan check: step predicted") and " ms (" in line
    plan = json.loads(results[0]["plan"])  # model.plan carries the same line, printed and in JSON
    assert plan["check"] == line
    assert plait.Plan.from_json(results[0]["plan"]).check == line and line in str(plait.Plan.from_json(results[0]["plan"]))
    check = results[0]["check"]
    assert check["measured_step_time_s"] > 0 and len(check["stages"]) == chosen["pp"] * chosen["num_virtual_stages"]
    assert all(s["measured_s"] > 0 and s["predicted_s"] > 0 for s in check["stages"])


@pytest.mark.timeout(180)
def test_split_points_cut_where_they_name_and_train_like_one_process():
    # mlp(): layers "0".."10"; split_points=["6"] starts stage 1 at module "6", as layers_per_stage=[6, 5]
    results = run_ranks(2, train, plait.Config(split_points=["6"], num_microbatches=2), timeout=170)
    assert_equal_to_one_process(results)
    plans = [json.loads(r["plan"]) for r in results]
    assert plans[0] == plans[1] and plans[0]["layers_per_stage"] == [6, 5]
    assert plans[0]["layer_names"][6] == "6" and results[0]["report"] is None  # given, not planned


def optimal_for_report(rank, world):
    """Config(num_stages=2): the layers are the exact partition of the profiled costs."""
    from plait.cost.prediction import partition_problem
    from plait.search.partition import optimal_partition

    result = train(rank, world, plait.Config(num_stages=2, num_microbatches=4), steps=2)
    data_ = json.loads(result["report"])
    from plait.planner.plan_report import PlanReport

    rep = PlanReport.from_dict(data_, "")
    problem = partition_problem(rep.costs, rep.setting(), rep.cluster, rep.global_batch)
    result["optimal"] = list(optimal_partition(problem).layers_per_stage)
    return result


@pytest.mark.timeout(180)
def test_num_stages_alone_gets_the_optimal_partition_on_every_rank():
    results = run_ranks(2, optimal_for_report, timeout=170)
    assert_equal_to_one_process(results)
    plans = [json.loads(r["plan"]) for r in results]
    assert plans[0] == plans[1]
    assert plans[0]["layers_per_stage"] == results[0]["optimal"] == results[1]["optimal"]
    report = json.loads(results[0]["report"])
    assert report["source"] == "partitioned" and report["pp"] == 2 and report["num_microbatches"] == 4
    # messages are priced with this backend's link as measured (plait.planner.calibrate), not a preset
    from plait.cost.devices import device

    assert report["cluster"]["network"] != device("cpu").network.to_dict()
    # (a loaded host can make the ping-pong fit's slope <= 0: the link is then "free", 1e15 B/s)
    assert 0 < report["cluster"]["network"]["intra"]["bandwidth"] <= 1e15


def save_then_replay(rank, world, path):
    x, y = data()
    first = plait.Model(mlp(), plait.Config(num_stages=2, num_microbatches=2), optimizer=sgd,
                        loss=nn.CrossEntropyLoss())
    first.build(x)
    if rank == 0:
        first.plan_report.save(path)
    torch.distributed.barrier()
    result = train(rank, world, plait.Config(plan=path), steps=5)  # 1 warm-up step, 3 measured (planner/check.py)
    result["first"] = first.plan.to_json()
    return result


@pytest.mark.timeout(180)
def test_a_saved_plan_replays_and_is_checked_against_its_prediction(tmp_path):
    """A replayed plan is checked as a planned one is: the issue asked that a plan file replayed
    report how far the measured step is from the predicted one."""
    path = str(tmp_path / "plan.json")
    results = run_ranks(2, save_then_replay, path, timeout=170)
    assert_equal_to_one_process(results)
    for r in results:
        first, again = json.loads(r["first"]), json.loads(r["plan"])
        for key in ("layers_per_stage", "num_microbatches", "schedule", "dp"):
            assert first[key] == again[key]
        assert json.loads(r["report"])["source"] == f"plan file {path}"
        assert r["feedback"] is not None and r["feedback"].startswith("plait plan check: step predicted "), r
        assert " s, measured " in r["feedback"] and r["check"]["predicted_step_time_s"] > 0 < r["check"]["measured_step_time_s"]
    assert results[0]["check"] == results[1]["check"]  # every rank reads the same check


def plan_with_the_command_then_replay(rank, world, root):
    """`plait plan --model ... -o plan.json` (rank 0; --device cpu: no link to measure), then
    Config(plan="plan.json") on 2 ranks, as the issue's user did."""
    from plait.cli.main import main

    plait.init_process_group(60.0)
    path = f"{root}/plan.json"
    if rank == 0:
        (Path(root) / "tiny.py").write_text("from tests.models import mlp as build\n")
        main(["plan", "--model", f"{root}/tiny.py:build", "--sample-shape", "32,8", "--devices", "2",
              "--device", "cpu", "--tp", "1", "--json", "-o", path])
    torch.distributed.barrier()
    return train(rank, world, plait.Config(plan=path), steps=5)


@pytest.mark.timeout(180)
def test_the_commands_plan_file_replays_and_is_checked_against_its_prediction(tmp_path):
    results = run_ranks(2, plan_with_the_command_then_replay, str(tmp_path), timeout=170)
    assert_equal_to_one_process(results)
    for r in results:
        assert json.loads(r["report"])["source"] == f"plan file {tmp_path}/plan.json"
        assert r["feedback"] is not None and r["feedback"].startswith("plait plan check: step predicted "), r
        assert r["check"]["predicted_step_time_s"] > 0 < r["check"]["measured_step_time_s"]


def test_config_zero_is_the_only_level_searched_and_none_searches_all():
    from plait.planner.choice import search_space as _space
    from plait.planner.layout import _users_zero

    assert _space(plait.Config(), 4, 64)[0].zero is None
    assert _space(plait.Config(zero=2), 4, 64)[0].zero == (2,)
    space, source = _space(plait.Config(num_stages=2, dp=2, zero=1), 4, 64)
    assert (space.pp, space.zero, source) == ((2,), (1,), "partitioned")
    assert _space(plait.Config(num_stages=2, dp=2), 4, 64)[0].zero is None  # the planner picks it
    assert _users_zero({"zero": 2, "dp": 2}, plait.Config()) == {"zero": 2, "dp": 2}
    assert _users_zero({"zero": 2, "dp": 2}, plait.Config(zero=0)) == {"zero": 0, "dp": 2}


def forced_replan(rank, world):
    """A replan moving one layer after step 4 (forced): training stays equal to one process,
    Adam's state included."""
    import plait.planner.closed_loop

    # where the closed loop reads it (plait.model no longer does: patching it there forced nothing,
    # and the test passed only while the measured step happened to be 15% off the prediction)
    plait.planner.closed_loop.should_replan = lambda feedback: True
    original = plait.planner.closed_loop.replanned_layers

    def moved(report, measured, world_size):
        answer = original(report, measured, world_size)
        layers = list(report.chosen["layers_per_stage"])
        layers[0], layers[1] = layers[0] + (1 if layers[1] > 1 else -1), layers[1] - (1 if layers[1] > 1 else -1)
        answer["chosen"] = {**answer["chosen"], "layers_per_stage": layers}
        return answer

    plait.planner.closed_loop.replanned_layers = moved
    result = train(rank, world, plait.Config(num_stages=2, num_microbatches=2, replan=True), steps=8,
                   make_opt=adam)
    return result


@pytest.mark.timeout(180)
def test_a_replan_moves_layers_and_training_stays_equal():
    results = run_ranks(2, forced_replan, timeout=170)
    assert_equal_to_one_process(results)
    report = json.loads(results[0]["report"])
    assert len(report["earlier_layouts"]) == 1
    old = json.loads(report["earlier_layouts"][0].split(" (step")[0])
    assert json.loads(results[0]["plan"])["layers_per_stage"] != old
    assert results[0]["plan"] == results[1]["plan"]
    assert results[0]["check"] is not None  # the new layout is checked again (steps 6..8)


@pytest.mark.parametrize("key", ["stage_tp", "stage_dp"])  # the plan's key is the Config field's name
def test_a_resumed_pipeline_of_stages_of_different_widths_keeps_its_widths(key):
    """Config() had chosen stages of different widths and saved a checkpoint: the resume runs
    that pipeline again (not a uniform one of its cut, which 3 ranks could not run)."""
    from plait.planner.layout import _fixed_tp
    from plait.planner.replay import resumed_fields as _resumed_fields
    from plait.planner.resolve import resolve_plan

    names = tuple(f"l{i}" for i in range(9))
    saved = {"world_size": 3, "layer_names": list(names), "layers_per_stage": [6, 3], "dp": 1, "tp": 1,
             "num_virtual_stages": 1, "num_microbatches": 2, "schedule": "1f1b", "recompute": [0, 1],
             key: [2, 1], "crossing": "whole"}
    if key == "stage_tp":
        saved["tp"] = 2
    fields = _resumed_fields(saved, plait.Config(), 3, names)
    assert fields is not None and fields[key] == [2, 1] and "pp" not in fields  # the widths give the stages
    assert ("crossing" in fields) == (key == "stage_tp") and fields.get("crossing", "whole") == "whole"
    assert _fixed_tp(SimpleNamespace(net=nn.Linear(2, 2)), plait.Config(), 3, saved) == (
        None if key == "stage_tp" else 1)  # the widest stage's tp is not the resumed layout's
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(9)])
    plan = resolve_plan(plait.Config(), 3, SimpleNamespace(layers=SimpleNamespace(layer_names=names, uncuttable=()),
                                                          method="fx", kept_whole=()), net, fields)
    assert getattr(plan, key) == (2, 1) and plan.world_size == 3 and plan.recompute == (0, 1)  # a plan the runtime takes


def test_one_stage_with_everything_given_is_not_planned():
    """One stage (num_stages=1, or dp over every lane) with its micro-batches, ZeRO level and
    recomputation given leaves the planner nothing to choose: no profile is taken (a zero=3 rank
    never holds the whole model's activations before its parameters are sharded)."""
    from plait.planner.layout import _nothing_to_choose

    given = dict(num_microbatches=2, zero=3, recompute=False)
    assert _nothing_to_choose(plait.Config(num_stages=1, **given), 4)
    assert _nothing_to_choose(plait.Config(dp=4, **given), 4)
    assert not _nothing_to_choose(plait.Config(dp=2, **given), 4)  # 2 stages to cut
    for open_field in given:  # each left open is the planner's to choose
        assert not _nothing_to_choose(plait.Config(num_stages=1, **{**given, open_field: None}), 4)
