"""Tests for plait.planner.plan_report: what a `PlanReport` reads off the chosen candidate, its JSON round
trip (the file `Config(plan=...)` replays), and its printed form."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from plait.cost.network import Link, Network
from plait.cost.prediction import Cluster, Setting
from plait.planner.plan_report import PlanReport
from plait.search.feedback import Feedback, StageCheck
from plait.search.search import SearchSpace, format_table, search
from tests.plan.factory import layer_costs

COSTS = layer_costs(4, forward=1.0, backward=2.0, activation=1.0, params=10.0)
CLUSTER = Cluster(Network(Link(0.0, 1e9), Link(0.0, 1e9), 2), 1e6)
GLOBAL_BATCH = 8


def planned(**extra: object) -> PlanReport:
    """The report of a search on 2 ranks: 2 stages of 2 layers, 4 micro-batches of 2 rows."""
    space = SearchSpace(pp=(2,), schedules=("1f1b", "gpipe"), num_microbatches=(4,))
    candidates = search(COSTS, 2, GLOBAL_BATCH, CLUSTER, space)
    return PlanReport(candidates[0].to_dict(), [c.to_dict() for c in candidates[1:]], format_table(candidates),
                      "planned", GLOBAL_BATCH, COSTS, CLUSTER, **extra)  # type: ignore[arg-type]


FEEDBACK = Feedback((StageCheck(0, 12.0, 13.2), StageCheck(1, 12.0, 12.0)), 60.0, 66.0)


def test_what_the_report_reads_off_the_chosen_candidate() -> None:
    report = planned()
    assert report.chosen["layers_per_stage"] == [2, 2] and report.chosen["schedule"] == "1f1b"
    # per stage, one micro-batch of 2 rows: 2 layers x (forward 1 + backward 2 per row) x 2 rows
    assert report.predicted_stage_s == [12.0, 12.0]
    assert report.predicted_step_s == pytest.approx(60.0)  # 1F1B, p=2, m=4: (m + p - 1) x 12
    assert report.setting() == Setting(2, 1, 4, "1f1b", 1, False)
    prediction = report.prediction()
    assert prediction.step_time_s == report.predicted_step_s
    assert [s.end - s.start for s in prediction.stages] == [2, 2]


def test_a_report_replayed_without_a_prediction() -> None:
    chosen = {"pp": 2, "dp": 2, "num_microbatches": 8, "schedule": "interleaved", "num_virtual_stages": 2,
              "recompute": True, "layers_per_stage": [1, 1, 1, 1]}
    report = PlanReport(chosen, [], "", "plan file p.json", 16)
    assert report.predicted_stage_s == [] and report.predicted_step_s is None
    assert report.setting() == Setting(2, 2, 8, "interleaved", 2, True)
    minimal = PlanReport({"pp": 1, "dp": 1, "num_microbatches": 1, "schedule": "gpipe"}, [], "", "x", 1)
    assert minimal.setting() == Setting(1, 1, 1, "gpipe")  # v and recompute default to 1 and False


def test_to_dict_is_the_chosen_fields_plus_the_context() -> None:
    report = planned()
    data = report.to_dict()
    assert set(data) == set(report.chosen) | {"alternatives", "global_batch", "source", "costs", "cluster"}
    assert {k: data[k] for k in report.chosen} == report.chosen
    # 1f1b and gpipe, each with weight gradients per micro-batch or batched, and recomputation
    assert (data["global_batch"], data["source"], len(data["alternatives"])) == (8, "planned", 4)
    assert data["costs"] == COSTS.to_dict()
    assert data["cluster"] == {"network": CLUSTER.network.to_dict(), "memory_bytes": 1e6,
                               "optimizer_state_factor": 2.0, "bucket_bytes": CLUSTER.bucket_bytes,
                               "overlap_gradients": True, "owner_reduces": True,
                               "recompute_by_layer": True}
    with_check = planned(feedback=FEEDBACK, history=("2 stages: [3, 1]",)).to_dict()
    assert with_check["feedback"] == FEEDBACK.to_dict()
    assert with_check["earlier_layouts"] == ["2 stages: [3, 1]"]


def test_the_json_round_trip_keeps_everything_but_the_check() -> None:
    report = planned(feedback=FEEDBACK, history=("2 stages: [3, 1]",))
    back = PlanReport.from_dict(json.loads(report.to_json()), report.table)
    assert back.feedback is None  # the check belongs to the run that measured it
    assert (back.chosen, back.alternatives, back.table, back.source, back.global_batch) == (
        report.chosen, report.alternatives, report.table, report.source, report.global_batch)
    assert back.costs == COSTS and back.cluster == CLUSTER
    assert list(back.history) == ["2 stages: [3, 1]"]
    assert back.prediction() == report.prediction()
    # the runtime's choices the cluster carries: gloo's sums after the pass, recomputation whole
    gloo = dataclasses.replace(CLUSTER, overlap_gradients=False, owner_reduces=False, recompute_by_layer=False)
    data = dataclasses.replace(report, cluster=gloo).to_dict()
    assert PlanReport.from_dict(json.loads(json.dumps(data)), report.table).cluster == gloo


def test_a_file_without_costs_replays_with_none() -> None:
    data = planned().to_dict()
    for key in ("costs", "cluster"):
        del data[key]
    back = PlanReport.from_dict(data, "table")
    assert (back.costs, back.cluster, back.table, list(back.history)) == (None, None, "table", [])


def test_save_writes_to_json(tmp_path: Path) -> None:
    report = planned()
    out = report.save(tmp_path / "plan.json")
    assert out == tmp_path / "plan.json"
    assert out.read_text() == report.to_json() == json.dumps(report.to_dict(), indent=1)


def test_printed_it_is_the_table_then_the_check_then_earlier_layouts() -> None:
    report = planned(feedback=FEEDBACK, history=("2 stages: [3, 1]", "2 stages: [1, 3]"))
    assert str(report).splitlines() == [
        "plait planner (planned), global batch 8:",
        *report.table.splitlines(),
        FEEDBACK.summary(),
        "earlier layout: 2 stages: [3, 1]",
        "earlier layout: 2 stages: [1, 3]",
    ]
    assert str(planned()) == "plait planner (planned), global batch 8:\n" + planned().table


def sharded() -> PlanReport:
    """The report of a search of ZeRO 1 and 2 on 2 replicas of one stage."""
    costs = layer_costs(4, forward=1.0, backward=2.0, activation=1.0, params=10.0, optimizer=1.0)
    candidates = search(costs, 2, GLOBAL_BATCH, CLUSTER, SearchSpace(pp=(1,), num_microbatches=(4,), zero=(1, 2)))
    return PlanReport(candidates[0].to_dict(), [c.to_dict() for c in candidates[1:]], format_table(candidates),
                      "planned", GLOBAL_BATCH, costs, CLUSTER)


def test_a_report_keeps_its_zero_level_and_each_ranks_memory() -> None:
    report = sharded()
    assert report.zero > 0 and report.setting().zero == report.zero == report.chosen["zero"]
    assert {"parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes"} <= set(report.chosen)
    assert report.chosen["optimizer_bytes"] == [4 * 2 * 10.0 / 2]  # Adam's state of 4 layers, halved
    back = PlanReport.from_dict(json.loads(report.to_json()), report.table)
    assert back.setting() == report.setting() and back.prediction() == report.prediction()
    assert back.prediction().optimizer_s == (pytest.approx(4 * 1.0 / 2),)
    assert f"zero={report.zero}" in str(back)


def test_json_saved_before_zero_was_priced_reads_as_zero_0() -> None:
    data = sharded().to_dict()
    for key in ("zero", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes"):
        del data[key]
    old = PlanReport.from_dict(data, "")
    assert old.zero == 0 and old.setting() == Setting(1, 2, 4, "1f1b", 1, False, 0)
    assert old.prediction().optimizer_s == (pytest.approx(4 * 1.0),)  # priced replicated, as it ran
