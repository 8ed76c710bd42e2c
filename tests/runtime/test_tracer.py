"""The tracer writes one Chrome trace per rank: events Perfetto reads, on a clock shared by ranks."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import pytest

from plait.runtime import tracer as trace
from plait.runtime.tracer import NULL_TRACER, STREAMS, NullTracer, Tracer, trace_path

pytestmark = pytest.mark.timeout(30)


def record_step(tracer: Tracer) -> None:
    """A 2-micro-batch stage-0 step with every stream the runtime uses."""
    for k in range(2):
        with tracer.span("compute", f"0F{k}", step=0, stage=0, op="F", mb=k):
            time.sleep(0.002)
        start = time.perf_counter_ns()
        tracer.add("send", f"0SF{k}", start, start + 1000, step=0, peer=1, mb=k)
    with tracer.span("wait", "0RB0", step=0, peer=1):
        pass
    tracer.add("recv", "0RB0", time.perf_counter_ns(), time.perf_counter_ns(), step=0, peer=1)
    for k in range(2):
        with tracer.span("compute", f"0B{k}", step=0, stage=0, op="B", mb=k):
            pass
    with tracer.span("allreduce", "bucket 0", step=0, bytes=4096):
        pass
    with tracer.span("compute", "optimizer", step=0, op="opt"):
        pass


def test_chrome_trace_schema(tmp_path: Path) -> None:
    meta = {"schedule": "1f1b", "num_stages": 2, "num_virtual_stages": 1, "pp": 2,
            "stage_to_rank": [0, 1], "world_size": 2}
    before_us = time.time_ns() / 1000
    for rank in range(2):
        tracer = Tracer(rank, meta)
        record_step(tracer)
        assert tracer.write(tmp_path / "run") == trace_path(tmp_path / "run", rank)
    after_us = time.time_ns() / 1000
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["rank0.json", "rank1.json"]

    for rank in range(2):
        document = json.loads((tmp_path / "run" / f"rank{rank}.json").read_text())
        assert document["displayTimeUnit"] == "ms"
        assert document["plait"] == {"format": 1, "rank": rank, **meta}
        events = document["traceEvents"]
        assert {e["pid"] for e in events} == {rank}  # one process per rank
        for e in events:
            assert {"ph", "name", "pid", "tid"} <= e.keys(), e
        spans = [e for e in events if e["ph"] == "X"]
        assert len(spans) == 10
        for e in spans:
            assert {"ts", "dur", "cat", "args"} <= e.keys(), e
            assert e["tid"] == STREAMS.index(e["cat"])  # a fixed track per stream
            assert before_us <= e["ts"] <= e["ts"] + e["dur"] <= after_us  # wall clock, in us
        forwards = [e for e in spans if e["name"].startswith("0F")]
        assert [e["args"] for e in forwards] == [{"step": 0, "stage": 0, "op": "F", "mb": k}
                                                 for k in range(2)]
        assert all(e["dur"] >= 2000 for e in forwards)  # slept 2 ms inside each
        meta_events = {(e["name"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
        assert meta_events[("process_name", 0)] == {"name": f"rank {rank}"}
        assert meta_events[("process_sort_index", 0)] == {"sort_index": rank}
        for tid, stream in enumerate(STREAMS):
            assert meta_events[("thread_name", tid)] == {"name": stream}
            assert meta_events[("thread_sort_index", tid)] == {"sort_index": tid}


def test_other_streams_follow_the_runtime_ones_and_unused_ones_get_no_track(
        tmp_path: Path) -> None:
    tracer = Tracer(3)
    tracer.add("data", "load", 0, 10)
    tracer.add("compute", "3F0", 10, 20, step=0, stage=3, op="F", mb=0)
    events = json.loads(tracer.write(tmp_path).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "compute", len(STREAMS): "data"}
    assert [e["dur"] for e in events if e["ph"] == "X"] == [0.01, 0.01]


def test_a_span_is_recorded_when_its_body_raises() -> None:
    tracer = Tracer(0)
    with pytest.raises(KeyError):
        with tracer.span("compute", "0F0", step=0, stage=0, op="F", mb=0):
            raise KeyError("boom")
    assert len(tracer) == 1


def test_null_tracer_does_nothing(tmp_path: Path) -> None:
    assert not NULL_TRACER.enabled and Tracer.enabled
    assert NULL_TRACER.span("compute", "0F0") is NULL_TRACER.span("send", "0SF0")  # reused
    with NULL_TRACER.span("compute", "0F0", step=0):
        pass
    NULL_TRACER.add("send", "0SF0", 0, 1)
    assert len(NULL_TRACER) == 0
    NullTracer(1).write(tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_tracer_imports_no_torch() -> None:
    tree = ast.parse(Path(trace.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in modules if m.split(".")[0] in ("torch", "plait")}, modules
