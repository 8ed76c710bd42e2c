"""`plait plan`: a described GPT planned offline, a user's model file profiled here, one JSON
object with the fields scripts read, and errors that say what to write."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from plait.cli.main import main

REQUIRED = {"pp", "dp", "tp", "num_microbatches", "schedule", "stages", "predicted_step_time_s",
            "peak_memory_bytes", "feasible"}
GPT_39B = "layers=48,hidden=8192,heads=64,seq=1024,vocab=51200"


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object, on one line
    return json.loads(out)


def test_gpt_39b_on_64_v100_needs_tensor_parallelism_or_offload(capsys):
    # at tp=1 it fits only with zero=3's shards and optimizer offloaded to host memory (priced with the
    # V100 node's PCIe 3.0 link and host memory bandwidth): feasible, and far slower than tp=8 below
    offloaded = run_json(capsys, "--gpt", GPT_39B, "--batch", "1024", "--devices", "64",
                         "--device", "v100-16gb", "--tp", "1")
    assert offloaded["feasible"] is True and offloaded["tp"] == 1 and offloaded["pp"] * offloaded["dp"] == 64
    assert offloaded["zero"] == 3 and offloaded["offload"] is True and offloaded["dp"] > 1
    assert offloaded["peak_memory_bytes"] <= 14.4 * 2**30
    assert all(c["offload"] for c in offloaded["alternatives"] if c["feasible"])  # only offload fits
    data = run_json(capsys, "--gpt", GPT_39B, "--batch", "1024", "--devices", "64",
                    "--device", "v100-16gb", "--tp", "1", "--no-offload")
    assert REQUIRED | {"reason"} <= set(data)
    assert data["feasible"] is False and data["tp"] == 1 and data["pp"] * data["dp"] == 64
    assert "tensor parallelism" in data["reason"]
    # not even with ZeRO: its closest layout shards the parameters too (zero=3) and, recomputed layer
    # by layer, needs 14.61 GiB of the 14.40 a V100 offers (16.11 with ZeRO-1/2, 25.11 without ZeRO)
    assert data["zero"] == 3 and data["peak_memory_bytes"] / 2**30 == pytest.approx(14.61, abs=0.01)
    replicated = run_json(capsys, "--gpt", GPT_39B, "--batch", "1024", "--devices", "64",
                          "--device", "v100-16gb", "--zero", "0", "--tp", "1", "--no-offload")
    assert replicated["zero"] == 0 and replicated["feasible"] is False
    assert replicated["peak_memory_bytes"] / 2**30 == pytest.approx(25.11, abs=0.01)
    assert "sharded optimizer state (ZeRO)" in replicated["reason"]
    # with tp = 1, 2, 4, 8 within a node (the default), it fits: 8 stages of 8 tp ranks, Megatron's
    # layout priced by plait.cost.analytic.gpt_tp_shares
    # (the full search, uneven widths and copies of a pipeline included; its planning time is
    # benchmarks/megatron_table.py's to print: a shared host doubled even its CPU seconds)
    split = run_json(capsys, "--gpt", GPT_39B, "--batch", "1024", "--devices", "64", "--device", "v100-16gb")
    assert split["feasible"] is True and split["tp"] == 8 and split["pp"] * split["dp"] == 8
    assert split["peak_memory_bytes"] <= 14.4 * 2**30 and not split["offload"]
    assert split["predicted_step_time_s"] < offloaded["predicted_step_time_s"] / 2  # offload: the last resort
    assert {c["tp"] for c in split["alternatives"]} >= {4}
    # Alpa's inter-operator pass at Alpa's scale: one pipeline of stages of different tp widths over
    # all 64 GPUs, priced beside the uniform layouts (on a GPT the uniform one is as good or better,
    # as Alpa found: its DP picks the equal-layer split)
    mixed = split["mixed_widths"]
    assert mixed is not None and sum(mixed["tp"]) == 64 and len(set(mixed["tp"])) == 2
    assert sum(mixed["layers_per_stage"]) == 50 and mixed["predicted_step_time_s"] >= split["predicted_step_time_s"]


def test_a_device_file_plans_as_the_device_it_describes(capsys, tmp_path):
    from plait.cost.devices import device
    path = tmp_path / "a100.json"
    path.write_text(json.dumps(device("a100-80gb").to_dict()))
    argv = ("--gpt", "layers=24,hidden=2304,heads=24,seq=2048,vocab=51200", "--batch", "512", "--devices", "32")
    preset, mine = run_json(capsys, *argv, "--device", "a100-80gb"), run_json(capsys, *argv, "--device", str(path))
    for key in ("pp", "dp", "tp", "num_microbatches", "predicted_step_time_s", "tflops_per_device"):
        assert mine[key] == preset[key]
    assert main(["plan", *argv, "--device", str(tmp_path / "none.json")]) == 1
    assert "device file" in capsys.readouterr().err


def test_gpt_350m_on_one_v100_fits(capsys):
    data = run_json(capsys, "--gpt", "layers=24,hidden=1024,heads=16", "--batch", "1024",
                    "--devices", "1", "--device", "v100-16gb")
    assert REQUIRED <= set(data) and data["feasible"] is True and "reason" not in data
    assert (data["pp"], data["dp"]) == (1, 1) and len(data["stages"]) == 1
    assert data["peak_memory_bytes"] <= 0.9 * 16 * 2**30
    assert data["predicted_step_time_s"] > 0 and data["alternatives"]


def test_a_gpt_plan_gives_its_predicted_tflops_per_device_by_megatrons_count(capsys):
    from plait.cost.analytic import megatron_flops, parse_gpt
    spec = "layers=24,hidden=2304,heads=24,seq=2048,vocab=51200"  # Megatron's 1.7B row
    data = run_json(capsys, "--gpt", spec, "--batch", "512", "--devices", "32", "--device", "a100-80gb")
    assert data["feasible"]
    want = megatron_flops(parse_gpt(spec), 512) / (data["predicted_step_time_s"] * 32) / 1e12
    assert data["tflops_per_device"] == pytest.approx(want)
    assert 0 < data["tflops_per_device"] < 312  # below the A100's bf16 peak
    assert main(["plan", "--gpt", spec, "--batch", "512", "--devices", "32", "--device", "a100-80gb"]) == 0
    assert f"predicted {data['tflops_per_device']:.1f} TFLOP/s per device" in capsys.readouterr().out


def test_zero_is_chosen_or_given_and_in_the_json(capsys):
    gpt = ["--gpt", "layers=8,hidden=512,heads=8,seq=256,vocab=1000", "--batch", "64", "--devices", "4",
           "--device", "a100-40gb"]
    chosen = run_json(capsys, *gpt)
    assert chosen["zero"] in (0, 1, 2) and all("zero" in c for c in chosen["alternatives"])
    given = run_json(capsys, *gpt, "--zero", "2")
    assert given["feasible"] and given["zero"] == 2 and given["dp"] > 1
    assert {c["zero"] for c in given["alternatives"]} == {2}
    parts = zip(given["parameter_bytes"], given["gradient_bytes"], given["optimizer_bytes"],
                given["activation_bytes"])
    assert max(map(sum, parts)) == pytest.approx(given["peak_memory_bytes"])


def test_a_given_layout_is_priced_as_given(capsys):
    # Megatron's 39.1B row (t=8, p=2 on 512 A100s, full recomputation) priced, not searched
    gpt = ["--gpt", "layers=48,hidden=8192,heads=64,seq=2048", "--batch", "1536", "--devices", "512",
           "--device", "a100-80gb"]
    given = run_json(capsys, *gpt, "--layout", "tp=8,pp=2,recompute=1,zero=0")
    assert given["layout"] == "tp=8,pp=2,recompute=1,zero=0"
    for c in [given, *given["alternatives"]]:
        assert (c["tp"], c["pp"], c["dp"], c["recompute"], c["zero"]) == (8, 2, 32, True, 0)
        assert all(stage["mesh"] == {"dp": 32, "tp": 8} for stage in c["stages"])
    assert 0 < given["tflops_per_device"] < 312
    with_m = run_json(capsys, *gpt, "--layout", "tp=8,dp=32,m=48,schedule=1f1b")
    assert (with_m["pp"], with_m["num_microbatches"], with_m["schedule"]) == (2, 48, "1f1b")
    kept = run_json(capsys, *gpt, "--layout", "tp=8,pp=2,recompute=0", "--memory-gb", "1000")
    assert not any(c["recompute"] for c in [kept, *kept["alternatives"]])
    # overlap=0: the gradients summed after the pipeline (Megatron-LM's local DDP), not during its
    # last gradient pass: the same layout, slower by at most the whole all-reduce
    late = run_json(capsys, *gpt, "--layout", "tp=8,pp=2,recompute=1,zero=0,m=16,schedule=1f1b,overlap=0")
    early = run_json(capsys, *gpt, "--layout", "tp=8,pp=2,recompute=1,zero=0,m=16,schedule=1f1b")
    assert late["predicted_step_time_s"] > early["predicted_step_time_s"] * 1.01
    assert late["tflops_per_device"] < early["tflops_per_device"]
    # the planner's own choice is never predicted slower than the layout it could have chosen
    free = run_json(capsys, *gpt)
    assert free["predicted_step_time_s"] <= given["predicted_step_time_s"] * (1 + 1e-9)


@pytest.mark.parametrize("layout, message", [
    ("tp=8,pp=3", "--layout tp=8,pp=3 does not divide --devices 64"),
    ("tp=8,pp=2,dp=2", "--layout tp=8 x pp=2 x dp=2 = 32, not --devices 64"),
    ("tp=two", "--layout tp='two' is not an integer"),
    ("width=2", "cannot read 'width=2' in --layout 'width=2'"),
    ("tp=0", "--layout tp=0 is out of range"),
    ("tp=8,recompute=2", "--layout recompute=2 is out of range"),
    ("tp=8,overlap=2", "--layout overlap=2 is out of range"),
])
def test_a_layout_that_cannot_be_is_named(capsys, layout, message):
    assert main(["plan", "--gpt", GPT_39B, "--batch", "1024", "--devices", "64", "--layout", layout]) == 1
    assert message in capsys.readouterr().err


def test_zero_outside_0_to_2_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--gpt", "layers=2,hidden=64,heads=4", "--batch", "8", "--devices", "2", "--zero", "3"])
    assert "--zero: invalid choice: 3 (choose from 0, 1, 2)" in capsys.readouterr().err


def test_table_lists_stages_and_alternatives(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    assert main(["plan", "--gpt", "layers=8,hidden=512,heads=8,seq=256,vocab=1000", "--batch", "64",
                 "--devices", "4", "--device", "a100-40gb", "--memory-gb", "20", "-o", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert "on 4 x a100-40gb (20.00 GiB each)" in text
    assert "stage  0 (rank 0): layers 0-" in text
    ranked = [line for line in text.splitlines() if line[:2].strip().isdigit()]
    assert [int(line[:2]) for line in ranked][:5] == [1, 2, 3, 4, 5]  # the chosen and 4 alternatives
    shown = {int(line.split()[3]) for line in ranked}  # the tp column: each tp's best is listed
    assert shown == {1, 2, 4}
    saved = json.loads(out_file.read_text())
    assert REQUIRED <= set(saved) and saved["device"] == "a100-40gb"


def test_a_model_file_is_profiled_and_planned(capsys, tmp_path, monkeypatch):
    model_file = tmp_path / "my_model.py"
    model_file.write_text(textwrap.dedent("""
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 4))
    """))
    data = run_json(capsys, "--model", f"{model_file}:build", "--sample-shape", "16,8",
                    "--devices", "2", "--schedules", "1f1b,gpipe")  # this host's link measured, as a job's
    measured = data["chosen"]  # the layout Config() runs on 2 ranks here (tests/planner/test_choice.py)
    assert measured["pp"] * measured["dp"] * measured["tp"] == 2
    from plait.plan import Plan
    from plait.planner.replay import load_plan_file

    plan = Plan.from_json(json.dumps(data["plan"]))  # ... and the complete Plan that job builds from them
    assert (plan.pp, plan.dp, plan.tp, plan.world_size) == (measured["pp"], measured["dp"], measured["tp"], 2)
    assert list(plan.layers_per_stage) == measured["layers_per_stage"] and plan.schedule == measured["schedule"]
    assert plan.num_microbatches == measured["num_microbatches"] and len(plan.layer_names) == 5
    assert (plan.tp > 1) == bool(plan.tp_layouts)  # completed: a split stage's layout is in it
    (tmp_path / "plan.json").write_text(json.dumps(data["plan"]))  # replayed by Config(plan=...)
    replayed, _ = load_plan_file(str(tmp_path / "plan.json"), plan.layer_names, 2)
    assert replayed["layers_per_stage"] == measured["layers_per_stage"] and replayed["dp"] == measured["dp"]
    from plait.cost.devices import device
    from plait.planner import calibrate

    monkeypatch.setattr(calibrate, "measure_here", lambda local_ranks: device("cpu").network)  # measured once is enough
    assert REQUIRED <= set(data) and data["feasible"] is True
    assert data["pp"] * data["dp"] * data["tp"] == 2 and data["global_batch"] == 16
    assert {c["tp"] for c in [data, *data["alternatives"]]} == {1, 2}  # tp=2 priced too (the MLP splits)
    one = run_json(capsys, "--model", f"{model_file}:build", "--sample-shape", "16,8", "--devices", "2", "--tp", "1")
    assert {c["tp"] for c in [one, *one["alternatives"]]} == {1}
    assert sum(s["num_layers"] for s in data["stages"]) == 5
    assert data["schedule"] in ("1f1b", "gpipe") and "profiled on" in data["costs"]
    assert data["mixed_widths"] is None  # two devices: no uneven split to search
    three = run_json(capsys, "--model", f"{model_file}:build", "--sample-shape", "16,8", "--devices", "3")
    mixed = three["mixed_widths"]  # searched on three: priced when a width splits, shown if one fits
    assert mixed is None or (sum(mixed["tp"]) == 3 and sum(mixed["layers_per_stage"]) == 5)
    assert data["mixed_dp"] is None and "mixed_dp" in three  # dp widths: searched on three (16 rows divide by 2)
    assert three["mixed_dp"] is None or (sum(three["mixed_dp"]["dp"]) == 3 and len(set(three["mixed_dp"]["dp"])) == 2)


def test_a_model_planned_in_bf16_is_profiled_in_it_and_holds_masters_beside_copies(capsys, tmp_path, monkeypatch):
    """`plait plan --model ... --precision bf16`: the Config() a bf16 job would run, its memory as the
    run holds it (fp32 masters and bf16 copies: 1.5x the fp32 parameters' bytes, fp32 gradients)."""
    from plait.cost.devices import device
    from plait.planner import calibrate

    monkeypatch.setattr(calibrate, "measure_here", lambda local_ranks: device("cpu").network)
    model_file = tmp_path / "wide.py"
    model_file.write_text(textwrap.dedent("""
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    """))
    args = ["--model", f"{model_file}:build", "--sample-shape", "16,64", "--devices", "1"]
    fp32, bf16 = run_json(capsys, *args), run_json(capsys, *args, "--precision", "bf16")
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    params = 64 * 256 + 256 + 256 * 64 + 64
    assert fp32["parameter_bytes"][0] == pytest.approx(4 * params, rel=0.01)
    assert bf16["parameter_bytes"][0] == pytest.approx(6 * params, rel=0.01)  # masters 4 + copies 2
    assert bf16["gradient_bytes"][0] == pytest.approx(fp32["gradient_bytes"][0], rel=0.01)  # fp32 both
    tp16 = run_json(capsys, *args[:-1], "2", "--tp", "2", "--layout", "tp=2", "--precision", "bf16")
    assert tp16["tp"] == 2 and tp16["feasible"]  # bf16 with tensor parallelism (its sums priced in fp32:
    assert tp16["parameter_bytes"][0] == pytest.approx(6 * params / 2, rel=0.05)  # tests/planner/test_tp_shares.py)
    assert main(["plan", "--gpt", "layers=2,hidden=64,heads=4", "--batch", "8", "--devices", "2",
                 "--precision", "bf16"]) == 1
    assert "--precision bf16 is for --model; --gpt prices its device preset's dtype" in capsys.readouterr().err


def test_a_model_s_stages_of_different_widths_come_from_its_graph() -> None:
    """`plait plan --model` prices stages of different widths on the captured graph's own split:
    the MLP whose heavy linear pair splits gets two of three ranks (as Config() does)."""
    import argparse

    from plait.cli.plan_command import _model_widths
    from tests.planner.test_widths import _setup

    captured, result, cluster = _setup(1e-3)
    args = argparse.Namespace(layout=None, devices=3, tp=None, pp=None, zero=None, microbatches=None, schedules=None,
                              recompute=(False, True), top=5, precision="fp32")
    found = _model_widths(args, captured, result, cluster).tp
    assert found is not None and sorted(found.widths) == [1, 2] and sum(found.layers_per_stage) == 6
    assert found.step_time_s < result.best.step_time_s
    given = argparse.Namespace(**{**vars(args), "layout": "tp=1", "recompute": (False,)})
    nothing = _model_widths(given, captured, result, cluster)  # a given layout: nothing else searched
    assert nothing.tp is None and nothing.dp is None


@pytest.mark.parametrize("argv, message", [
    (["--gpt", "layers=2,hidden=64,heads=4", "--devices", "2"], "--gpt needs --batch"),
    (["--gpt", "layers=2,hidden=64", "--batch", "8", "--devices", "2"], "lacks heads"),
    (["--gpt", "layers=2,hidden=64,heads=4", "--batch", "8", "--devices", "2", "--device", "tpu"],
     "unknown device 'tpu'"),
    (["--model", "nowhere.py:build", "--sample-shape", "4,2", "--devices", "1"], "no file 'nowhere.py'"),
    (["--model", "torch.nn:Linear", "--devices", "1"], "needs --sample-shape"),
])
def test_errors_say_what_to_write(capsys, argv, message):
    assert main(["plan", *argv]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_run_as_a_user_runs_it():
    result = subprocess.run(
        [sys.executable, "-m", "plait.cli", "plan", "--gpt", "layers=24,hidden=2048,heads=32",
         "--batch", "1024", "--devices", "4", "--json"],
        capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["feasible"] and data["pp"] * data["dp"] * data["tp"] == 4 and data["device"] == "v100-16gb"


def test_stages_of_different_widths_are_priced_beside_the_uniform_layouts(capsys):
    # 3 GPUs: uniform tp must divide 3 (tp=1 only); one pipeline may put its stages on 2 + 1
    gpt = ["--gpt", "layers=2,hidden=1024,heads=16,vocab=50257", "--batch", "8", "--device", "a100-40gb"]
    data = run_json(capsys, *gpt, "--devices", "3")
    mixed = data["mixed_widths"]
    assert mixed is not None and sum(mixed["tp"]) == 3 and len(set(mixed["tp"])) == 2
    assert sum(mixed["layers_per_stage"]) == 4 and mixed["predicted_step_time_s"] > mixed["pipeline_s"] > 0
    assert {c["tp"] for c in [data, *data["alternatives"]]} == {1}
    assert run_json(capsys, *gpt, "--devices", "128")["mixed_widths"] is None  # over the size searched


def test_stages_of_different_dp_widths_are_priced_beside_the_uniform_layouts(capsys):
    # 3 GPUs, 8 sequences: one pipeline may run a stage as 2 replicas of half of each micro-batch's rows
    gpt = ["--gpt", "layers=2,hidden=1024,heads=16,vocab=50257", "--batch", "8", "--device", "a100-40gb"]
    data = run_json(capsys, *gpt, "--devices", "3")
    mixed = data["mixed_dp"]
    assert mixed is not None and sum(mixed["dp"]) == 3 and len(set(mixed["dp"])) == 2
    assert all((8 // mixed["num_microbatches"]) % w == 0 for w in mixed["dp"]) and 8 % mixed["num_microbatches"] == 0
    assert sum(mixed["layers_per_stage"]) == 4 and mixed["predicted_step_time_s"] > mixed["pipeline_s"] > 0
    assert run_json(capsys, *gpt, "--devices", "3", "--microbatches", "8")["mixed_dp"] is None  # 1 row each
    assert run_json(capsys, *gpt, "--devices", "3", "--layout", "tp=1,pp=3")["mixed_dp"] is None  # that layout only
