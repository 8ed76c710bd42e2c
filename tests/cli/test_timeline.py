"""Trace directories load, a step's bubble is measured exactly, and the charts come out as PNGs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from plait.cli import timeline
from plait.cli.main import main as plait_main
from plait.runtime.tracer import Tracer
from plait.schedule import simulate

pytestmark = pytest.mark.timeout(120)

EPOCH_US = 1.7e15  # any wall-clock origin: the loader measures from the earliest span
META = {"schedule": "1f1b", "num_stages": 2, "num_virtual_stages": 1, "pp": 2,
        "stage_to_rank": [0, 1], "world_size": 2}


def write_rank(trace_dir: Path, rank: int, spans: list[tuple[Any, ...]],
               meta: dict[str, Any] = META) -> None:
    """Write rank{rank}.json by hand: spans are (stream, name, start_ms, end_ms, args)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    events = [{"ph": "X", "name": name, "cat": stream, "pid": rank, "tid": 0,
               "ts": EPOCH_US + a * 1000, "dur": (b - a) * 1000, "args": args}
              for stream, name, a, b, args in spans]
    document = {"traceEvents": events, "displayTimeUnit": "ms",
                "plait": {"format": 1, "rank": rank, **meta}}
    (trace_dir / f"rank{rank}.json").write_text(json.dumps(document))


def op(step: int, stage: int, name: str, mb: int, a: float, b: float) -> tuple[Any, ...]:
    return ("compute", f"{stage}{name}{mb}", a, b,
            {"step": step, "stage": stage, "op": name, "mb": mb})


def opt(step: int, a: float, b: float) -> tuple[Any, ...]:
    return ("compute", "optimizer", a, b, {"step": step, "op": "opt"})


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    """Two ranks, one micro-batch; step 1 has a known bubble, step 2 was cut short.

        ms      0    1    2    3    4    5    6     (step 1 starts at 10 ms)
        rank 0  [F0 ]                [ B0    ][opt]
        rank 1       [F0 ][ B0         ]      [opt]

    Step 1's window is 10-15 ms (F/B only, the optimizer is not pipeline work); rank 0 works
    1 + 2 ms of it and rank 1 1 + 2 ms: bubble = 1 - 6 / (2 * 5) = 0.4.
    """
    trace_dir = tmp_path / "trace"
    rank0, rank1 = [], []
    for step, t in ((0, 0.0), (1, 10.0)):
        rank0 += [op(step, 0, "F", 0, t, t + 1), op(step, 0, "B", 0, t + 3, t + 5),
                  opt(step, t + 5, t + 6)]
        rank1 += [op(step, 1, "F", 0, t + 1, t + 2), op(step, 1, "B", 0, t + 2, t + 4),
                  opt(step, t + 5, t + 6)]
    rank0 += [("recv", "0RB0", 10.5, 13.0, {"step": 1}), ("wait", "0RB0", 11.0, 13.0, {"step": 1}),
              ("send", "0SF0", 11.0, 11.1, {"step": 1}), op(2, 0, "F", 0, 20, 21)]
    rank1 += [("recv", "1RF0", 10.2, 11.0, {"step": 1}), ("send", "1SB0", 14.0, 14.2, {"step": 1})]
    write_rank(trace_dir, 0, rank0)
    write_rank(trace_dir, 1, rank1)
    return trace_dir


def test_load_and_bubble_fraction_of_a_known_trace(small_trace: Path) -> None:
    trace = timeline.load(small_trace)
    assert trace.meta == {"format": 1, **META}
    assert sorted(trace.spans) == [0, 1]
    assert trace.spans[0][0].start == 0.0 and trace.spans[1][0].start == 1.0  # ms, one origin
    assert trace.complete_steps() == [0, 1]  # step 2 has no backward: not complete
    assert trace.resolve_step(None) == 1
    assert trace.window(1) == (10.0, 15.0)
    assert timeline.bubble_fraction(trace, 1) == pytest.approx(0.4)
    assert timeline.bubble_fraction(trace) == pytest.approx(0.4)
    assert timeline.stage_times(trace, 1) == {"F": [1.0, 1.0], "B": [2.0, 2.0], "W": [0.0, 0.0]}
    with pytest.raises(ValueError, match=r"step 2 is not a complete .*; complete steps: \[0, 1\]"):
        timeline.bubble_fraction(trace, 2)


def test_a_tracer_file_loads_back(tmp_path: Path) -> None:
    for rank in range(2):
        tracer = Tracer(rank, META)
        tracer.add("compute", f"{rank}F0", 1_000_000, 3_000_000, step=0, stage=rank, op="F", mb=0)
        tracer.add("compute", f"{rank}B0", 3_000_000, 7_000_000, step=0, stage=rank, op="B", mb=0)
        tracer.add("allreduce", "bucket 0", 5_000_000, 8_000_000, step=0)
        tracer.write(tmp_path)
    trace = timeline.load(tmp_path)
    spans = trace.spans[1]
    assert [(s.stream, s.name, s.op) for s in spans] == [
        ("compute", "1F0", "F"), ("compute", "1B0", "B"), ("allreduce", "bucket 0", None)]
    assert [s.end - s.start for s in spans] == pytest.approx([2.0, 4.0, 3.0])
    assert timeline.stage_times(trace)["B"] == pytest.approx([4.0, 4.0])


def test_load_errors_name_the_directory_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist; point at .*trace_dir"):
        timeline.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no rank<r>.json files in .*empty; point at"):
        timeline.load(tmp_path / "empty")
    (tmp_path / "chrome").mkdir()
    (tmp_path / "chrome" / "rank0.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match=r"rank0.json is not a plait trace"):
        timeline.load(tmp_path / "chrome")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "rank0.json").write_text('{"traceEvents": [')
    with pytest.raises(ValueError, match=r"rank0.json is not valid JSON"):
        timeline.load(tmp_path / "cut")
    write_rank(tmp_path / "eval", 0, [op(0, 0, "F", 0, 0, 1)])
    with pytest.raises(ValueError, match=r"no complete training step in the trace .*eval; "
                                         r"complete steps: none \(trace at least one whole"):
        timeline.bubble_fraction(timeline.load(tmp_path / "eval"))


# ---- charts --------------------------------------------------------------------------------------


def measured_trace(trace_dir: Path, schedule: str, p: int, m: int, seed: int = 0) -> Path:
    """A made-up run of two steps shaped like the runtime's: jittered op times, a receive and a
    wait before each op fed by a neighbour, a send after, and the optimizer at the end."""
    rng = random.Random(seed)
    spans: dict[int, list[tuple[Any, ...]]] = {r: [] for r in range(p)}
    t0 = 0.0
    for step in range(2):
        sim = simulate(schedule, p, m, 1.0, 2.0, t_comm=0.3)
        for e in sim.timeline:
            jitter = rng.uniform(0.9, 1.2) * (1.6 if step == 0 else 1.0)  # warm-up is slower
            a, b = t0 + e.start, t0 + e.start + (e.end - e.start) * jitter
            fed = e.stage_index > 0 if e.op == "F" else e.stage_index < p - 1
            if fed:
                spans[e.rank].append(("recv", "recv", a - 0.6, a - 0.05, {"step": step}))
                spans[e.rank].append(("wait", "wait", a - 0.3, a - 0.05, {"step": step}))
            spans[e.rank].append(op(step, e.stage_index, e.op, e.microbatch_index, a, b))
            if (e.op == "F" and e.stage_index < p - 1) or (e.op == "B" and e.stage_index > 0):
                spans[e.rank].append(("send", "send", b, b + 0.08, {"step": step}))
        end = max(s[3] for r in spans for s in spans[r])
        for r in range(p):
            spans[r].append(opt(step, end, end + 0.8))
        t0 = end + 3
    meta = {**META, "schedule": schedule, "num_stages": p, "pp": p,
            "stage_to_rank": list(range(p)), "world_size": p}
    for r in range(p):
        write_rank(trace_dir, r, spans[r], meta)
    return trace_dir


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000, len(data)  # boxes, labels and a legend, not a blank canvas


def test_draw_measured_and_simulation(tmp_path: Path, small_trace: Path) -> None:
    assert_png(timeline.draw_measured(timeline.load(small_trace), tmp_path / "small.png", planned=False))
    trace = timeline.load(measured_trace(tmp_path / "run", "1f1b", 4, 8))
    assert_png(timeline.draw_measured(trace, tmp_path / "measured.png", step=0, planned=False))
    sim = simulate("gpipe", 4, 8, 1.0, 2.0)
    assert_png(timeline.draw_simulation(sim, tmp_path / "sub" / "gpipe.png", schedule="gpipe"))


def test_cli_timeline_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace_dir = measured_trace(tmp_path / "run", "1f1b", 4, 8)
    out, merged = tmp_path / "timeline.png", tmp_path / "all.json"
    assert plait_main(["timeline", str(trace_dir), "-o", str(out), "--perfetto", str(merged)]) == 0
    bubble = timeline.bubble_fraction(timeline.load(trace_dir), 1)
    assert capsys.readouterr().out == (f"step 1: measured bubble {bubble:.1%}; wrote {out}\n"
                                       f"wrote {merged}\n")
    assert_png(out)
    events = json.loads(merged.read_text())["traceEvents"]  # every rank in one file
    assert len(events) == sum(len(json.loads(f.read_text())["traceEvents"])
                              for f in trace_dir.iterdir())
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert plait_main(["timeline", str(trace_dir), "-o", str(out), "--step", "5"]) == 1
    assert "step 5 is not a complete training step" in capsys.readouterr().err
    assert plait_main(["timeline", str(tmp_path / "none"), "-o", str(out)]) == 1
    assert "none does not exist; point at" in capsys.readouterr().err


@pytest.mark.parametrize("schedule, v, t_w", [("gpipe", 1, 0), ("1f1b", 1, 0),
                                              ("interleaved", 2, 0), ("zbh1", 1, 1)])
def test_a_trace_that_follows_its_plan_measures_the_planned_bubble(
        tmp_path: Path, schedule: str, v: int, t_w: float) -> None:
    # Replaying a simulated step as a trace must give back the same step: the per-stage times
    # (p * v of them, chunk c of rank r being stage c * p + r), the plan and the bubble.
    sim = simulate(schedule, 2, 4, 1.0, 2.0, t_w=t_w, num_virtual_stages=v)
    meta = {"schedule": schedule, "num_stages": 2 * v, "num_virtual_stages": v, "pp": 2}
    for rank in range(2):
        write_rank(tmp_path, rank, [op(7, e.stage_index, e.op, e.microbatch_index, e.start, e.end)
                                    for e in sim.timeline if e.rank == rank], meta)
    trace = timeline.load(tmp_path)
    assert timeline.stage_times(trace)["F"] == pytest.approx([1.0 / v] * 2 * v)
    assert timeline.stage_times(trace)["W"] == pytest.approx([t_w] * 2 * v)
    planned = timeline.plan(trace)
    assert planned.step_time == pytest.approx(sim.step_time)
    assert timeline.bubble_fraction(trace) == pytest.approx(sim.bubble_fraction)
    assert_png(timeline.draw_measured(trace, tmp_path / "t.png"))


def test_cli_simulate_prints_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.png"
    result = subprocess.run(  # a fresh interpreter, as a user runs it
        [sys.executable, "-m", "plait.cli", "simulate", "--schedule", "gpipe", "--stages", "4",
         "--microbatches", "8", "--t-f", "1", "--t-b", "2", "-o", str(out)],
        capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("gpipe: p=4 stages, m=8 micro-batches, v=1 chunk(s) per rank\n"
                             "step time         33 ms\n"
                             "bubble fraction   27.3%\n"
                             "peak activations  8, 8, 8, 8 (micro-batches held at once, per rank)\n"
                             f"wrote {out}\n")
    assert_png(out)
    assert plait_main(["simulate", "--schedule", "nope", "--stages", "4", "--microbatches", "8",
                     "--t-f", "1", "--t-b", "2"]) == 1
    assert capsys.readouterr().err.startswith(
        "plait simulate: error: unknown schedule 'nope'; known schedules: 1f1b, gpipe")


@pytest.mark.parametrize("args, message", [
    (["--stages", "0"], "argument --stages: must be a whole number >= 1, got '0'"),
    (["--t-f", "-1"], "argument --t-f: must be a time in ms >= 0, such as 1.5, got '-1'"),
    (["--t-b", "fast"], "argument --t-b: must be a time in ms >= 0, such as 1.5, got 'fast'"),
])
def test_cli_simulate_rejects_bad_numbers(args: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--stages": "4", "--microbatches": "8", "--t-f": "1", "--t-b": "2"}
    base.update(zip(args[::2], args[1::2]))
    with pytest.raises(SystemExit) as exit_info:
        plait_main(["simulate", *[x for kv in base.items() for x in kv]])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_drawing_without_matplotlib_says_how_to_install(
        small_trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if absent
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install 'plait\[plot\]'"):
        timeline.draw_measured(timeline.load(small_trace), tmp_path / "x.png", planned=False)
    assert not (tmp_path / "x.png").exists()


def test_send_times_and_transfer_time_of_a_known_trace(tmp_path: Path) -> None:
    """Two micro-batches over two ranks; every hand-over below is drawn to the millisecond.

        ms      0    1    2    3    4    5    6    7    8    9   10   11
        rank 0  F0 SF0 F1 SF1 |-- RB0 waits --|B0 |-RB1-|B1
        rank 1  |RF0 waits |F0 B0 SB0 |RF1|F1 B1 SB1

    SF0 ends at 1.5, rank 1's RF0 (waiting since 0) ends at 2.5: 1 ms in flight. SB0 ends at
    5.5 and RB0 (waiting since 4) ends at 6.5: 1 ms. RF1 started after SF1 ended, so it tells
    nothing; RB1 started at 7.5, before SB1 ended at 8.5, and ended at 9.5: 1 ms again.
    """
    rank0, rank1 = _hand_overs()
    write_rank(tmp_path, 0, rank0)
    write_rank(tmp_path, 1, rank1)
    trace = timeline.load(tmp_path)
    assert timeline.transfer_time(trace, 0) == pytest.approx(1.0)
    sends = timeline.send_times(trace, 0)
    assert sends["F"] == pytest.approx([0.5, 0.0])  # two SF of 0.5 ms over two micro-batches
    assert sends["B"] == pytest.approx([0.125, 0.5])  # one posted RB of 0.25 ms; SB 0.5 each


def test_each_rank_hears_from_its_own_lane_with_tp(tmp_path: Path) -> None:
    # The story: the timeline found a receive's sender as rank // pp * pp + stage % pp, which is a
    # rank of the receiver's own stage once tp > 1 (at pp = tp = 2, rank 3's sender is rank 1, not
    # rank 2), so every hand-over went unmatched and the transfer time read 0. It asks the mesh now.
    rank0, rank1 = _hand_overs()  # stage 0 on ranks 0 1 (its tp ranks), stage 1 on ranks 2 3
    meta = {**META, "world_size": 4, "tp": 2, "stage_to_rank": [0, 2]}
    for rank, spans in ((0, rank0), (1, rank0), (2, rank1), (3, rank1)):
        write_rank(tmp_path, rank, spans, meta)
    trace = timeline.load(tmp_path)
    assert trace.mesh.lane_ranks(3) == (1, 3)
    assert timeline.transfer_time(trace, 0) == pytest.approx(1.0)


def _hand_overs() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The two ranks' spans of `test_send_times_and_transfer_time_of_a_known_trace`'s picture."""
    def io(step: int, stage: int, name: str, mb: int, a: float, b: float, stream: str) -> tuple[Any, ...]:
        return (stream, f"{stage}{name}{mb}", a, b, {"step": step, "stage": stage, "op": name, "mb": mb})

    rank0 = [op(0, 0, "F", 0, 0, 1), io(0, 0, "SF", 0, 1, 1.5, "send"),
             io(0, 0, "PRB", 0, 1.5, 1.75, "recv"),
             op(0, 0, "F", 1, 2, 3), io(0, 0, "SF", 1, 3, 3.5, "send"),
             io(0, 0, "RB", 0, 4, 6.5, "recv"), op(0, 0, "B", 0, 6.5, 7.5),
             io(0, 0, "RB", 1, 7.5, 9.5, "recv"), op(0, 0, "B", 1, 9.5, 10.5)]
    rank1 = [io(0, 1, "RF", 0, 0, 2.5, "recv"), op(0, 1, "F", 0, 2.5, 3.5),
             op(0, 1, "B", 0, 3.5, 5), io(0, 1, "SB", 0, 5, 5.5, "send"),
             io(0, 1, "RF", 1, 5.5, 5.6, "recv"), op(0, 1, "F", 1, 5.6, 6.5),
             op(0, 1, "B", 1, 6.5, 8), io(0, 1, "SB", 1, 8, 8.5, "send")]
    return rank0, rank1
