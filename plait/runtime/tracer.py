"""A rank's measured timeline (compute, send, receive, wait, all-reduce) as Chrome trace JSON."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, ContextManager

__all__ = ["STREAMS", "Tracer", "NullTracer", "NULL_TRACER", "trace_path"]

STREAMS: tuple[str, ...] = ("compute", "recv", "send", "wait", "allreduce")
"""The runtime's streams, in track order; a stream's index here is its Chrome `tid`."""

FORMAT_VERSION = 1  # bump when the meaning of a field changes; `plait.cli.timeline` checks it


def trace_path(trace_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank `rank` writes its trace: `trace_dir/rank{rank}.json`."""
    return Path(trace_dir) / f"rank{rank}.json"


class _Span:
    """`with tracer.span(...)`: records perf_counter_ns at enter and exit (a class: no generator)."""

    __slots__ = ("_tracer", "_stream", "_name", "_args", "_start")

    def __init__(self, tracer: Tracer, stream: str, name: str, args: dict[str, Any]) -> None:
        self._tracer, self._stream, self._name, self._args = tracer, stream, name, args
        self._start = 0

    def __enter__(self) -> None:
        self._start = time.perf_counter_ns()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._tracer.add(self._stream, self._name, self._start, time.perf_counter_ns(),
                         **self._args)


class Tracer:
    """Collects one rank's spans in memory; `write` saves them as `trace_dir/rank{rank}.json`.

    Times are taken with `time.perf_counter_ns()` (monotonic, fine-grained). At creation the
    tracer reads `time.time_ns()` right after `perf_counter_ns()`, and every span is written at
    wall-clock time `wall0 + (t - perf0)`, in microseconds since the Unix epoch. The epoch is the
    common origin: ranks are separate processes, and on one host they share the wall clock, so
    their files line up without any exchange between ranks. Across hosts the tracks are off by
    the hosts' clock difference (NTP keeps it around a millisecond or less).

    The file (one Chrome trace per rank; Perfetto opens it, `plait timeline` draws a directory):

        {"traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "compute"}},
            ...sort-index events...,
            {"ph": "X", "name": "0F3", "cat": "compute", "pid": 0, "tid": 0,
             "ts": 1712345678901234.5, "dur": 812.25,
             "args": {"step": 2, "stage": 0, "op": "F", "mb": 3}},
            ...],
         "displayTimeUnit": "ms",
         "plait": {"format": 1, "rank": 0, "schedule": "1f1b", "num_stages": 4, ...}}

    pid is the rank; tid is the stream's index in STREAMS (other streams follow, in order of
    first use). Compute spans are named by their action text (`0F3`) or `optimizer` and carry
    {"step", "stage", "op": "F"|"B"|"W"|"opt", "mb"}.
    """

    enabled = True

    def __init__(self, rank: int, meta: dict[str, Any] | None = None) -> None:
        self.rank = rank
        self.meta: dict[str, Any] = dict(meta or {})
        self._perf0 = time.perf_counter_ns()
        self._wall0 = time.time_ns()
        self._spans: list[tuple[str, str, int, int, dict[str, Any]]] = []

    def span(self, stream: str, name: str, **args: Any) -> ContextManager[None]:
        """Time the body of a `with` block as one span of `stream`."""
        return _Span(self, stream, name, args)

    def add(self, stream: str, name: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """Record a span measured elsewhere (`time.perf_counter_ns()` values), e.g. an isend."""
        self._spans.append((stream, name, start_ns, end_ns, args))

    def __len__(self) -> int:
        return len(self._spans)

    def streams(self) -> list[str]:
        """STREAMS first, then any other stream in order of first use: index = tid."""
        extra = dict.fromkeys(s for s, *_ in self._spans if s not in STREAMS)
        return [*STREAMS, *extra]

    def events(self) -> list[dict[str, Any]]:
        """The Chrome trace events: metadata (names, sort order) first, then one "X" per span."""
        tids = {stream: tid for tid, stream in enumerate(self.streams())}
        used = dict.fromkeys(s for s, *_ in self._spans)
        pid = self.rank
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": f"rank {self.rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
             "args": {"sort_index": self.rank}},
        ]
        for stream in [s for s in tids if s in used or s == "compute"]:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[stream],
                           "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                           "tid": tids[stream], "args": {"sort_index": tids[stream]}})
        offset_ns = self._wall0 - self._perf0
        for stream, name, start_ns, end_ns, args in self._spans:
            events.append({
                "ph": "X", "name": name, "cat": stream, "pid": pid, "tid": tids[stream],
                # float microseconds since the epoch: a double keeps ~0.25 us at this size
                "ts": (start_ns + offset_ns) / 1000, "dur": max(end_ns - start_ns, 0) / 1000,
                "args": args,
            })
        return events

    def write(self, trace_dir: str | os.PathLike[str]) -> Path:
        """Write `trace_dir/rank{rank}.json` (directory made if needed); returns its path."""
        path = trace_path(trace_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "traceEvents": self.events(),
            "displayTimeUnit": "ms",
            "plait": {"format": FORMAT_VERSION, "rank": self.rank, **self.meta},
        }
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(document, separators=(",", ":")))
        os.replace(partial, path)  # a reader never sees half a file
        return path


class NullTracer:
    """Tracing off: the same interface, and `span` returns one shared do-nothing context."""

    enabled = False
    _NULL: ContextManager[None] = contextlib.nullcontext()

    def __init__(self, rank: int = 0, meta: dict[str, Any] | None = None) -> None:
        self.rank = rank
        self.meta: dict[str, Any] = dict(meta or {})

    def span(self, stream: str, name: str, **args: Any) -> ContextManager[None]:
        return self._NULL

    def add(self, stream: str, name: str, start_ns: int, end_ns: int, **args: Any) -> None:
        pass

    def __len__(self) -> int:
        return 0

    def write(self, trace_dir: str | os.PathLike[str]) -> None:
        pass


NULL_TRACER = NullTracer()
"""The tracer used when `Config.trace_dir` is None."""
