"""plait's own overheads, timed in one process: the planner's search and a trace span.

(a) The search (`plait.search.search.search`) on Alpa's GPT suite (GPT-350M on 1 GPU up to
    GPT-39B on 64 V100-16GB, the costs from `plait.cost.analytic.gpt_costs`): the wall time of
    each plan, the median of `--repeats`. Target: under 2 s each.
(b) A trace span (`plait.runtime.tracer.Tracer.span`) around an empty body, and the span of the
    tracer that records nothing (`NULL_TRACER`, what a run without `trace_dir` uses), against a
    bare `with` of an empty context manager: the median over `--repeats` rounds of 20,000 spans.
    Targets: a span under 50 us, a null span under 10 us (a pipeline step holds a few spans per
    action, each action a millisecond or more).

These were unit-test assertions once; on a shared 2-core machine a timed assertion flakes, so
they are measured here, both sides printed, and the verdict given.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

try:
    import plait  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plait.cost.analytic import ALPA_GPT_SUITE, gpt_costs
from plait.cost.memory import optimizer_state_factor
from plait.cost.prediction import Cluster
from plait.cost.devices import device
from plait.search.search import search
from plait.runtime.tracer import NULL_TRACER, Tracer

SEARCH_TARGET_S = 2.0
SPAN_TARGET_S, NULL_SPAN_TARGET_S = 50e-6, 10e-6
SPANS = 20_000  # spans per round


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def time_search(repeats: int) -> bool:
    """(a) Every plan of Alpa's GPT suite, the median wall time of `repeats` searches."""
    dev = device("v100-16gb")
    cluster = Cluster(dev.network, dev.usable_memory(), optimizer_state_factor("adam", dev.dtype_bytes))
    print(f"(a) the search on Alpa's GPT suite, V100-16GB, global batch 1024; median of {repeats} (s)")
    print("| GPUs | model | search (s) | target (s) | chosen | verdict |")
    print("|---|---|---|---|---|---|")
    ok = True
    for gpus in sorted(ALPA_GPT_SUITE):
        label, spec = ALPA_GPT_SUITE[gpus]
        costs = gpt_costs(spec, dev)
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            found = search(costs, gpus, 1024, cluster)
            walls.append(time.perf_counter() - start)
        best = found[0]
        chosen = (f"pp {best.setting.pp} x dp {best.setting.dp}, m={best.setting.num_microbatches}"
                  if best.feasible else "infeasible")
        wall = statistics.median(walls)
        ok &= wall < SEARCH_TARGET_S
        print(f"| {gpus} | GPT-{label} | {wall:.3f} | {SEARCH_TARGET_S:.0f} | {chosen} | "
              f"{verdict(wall < SEARCH_TARGET_S)} |")
    return ok


def _per_span(span: contextlib.AbstractContextManager[None] | None, tracer: Tracer | None) -> float:
    """Seconds per `with` over SPANS spans: of `tracer.span(...)`, or of the one manager `span`."""
    start = time.perf_counter()
    if tracer is not None:
        for _ in range(SPANS):
            with tracer.span("compute", "0F0", step=0, stage=0, op="F", mb=0):
                pass
    else:
        assert span is not None
        for _ in range(SPANS):
            with span:
                pass
    return (time.perf_counter() - start) / SPANS


def time_spans(repeats: int) -> bool:
    """(b) A recording span, a null span and a bare `with`, the median of `repeats` rounds."""
    recording, null, bare = [], [], []
    for _ in range(repeats):
        recording.append(_per_span(None, Tracer(0)))  # a fresh tracer: its list starts empty
        null.append(_per_span(None, NULL_TRACER))  # type: ignore[arg-type]
        bare.append(_per_span(contextlib.nullcontext(), None))
    span, null_span, bare_with = (statistics.median(v) for v in (recording, null, bare))
    print(f"\n(b) a trace span around an empty body, median of {repeats} rounds of {SPANS} (us)")
    print("| span | per span (us) | bare `with` (us) | span / bare | target (us) | verdict |")
    print("|---|---|---|---|---|---|")
    rows = [("Tracer.span", span, SPAN_TARGET_S), ("NULL_TRACER.span", null_span, NULL_SPAN_TARGET_S)]
    ok = True
    for name, value, target in rows:
        ok &= value < target
        print(f"| {name} | {value * 1e6:.2f} | {bare_with * 1e6:.2f} | {value / bare_with:.1f} | "
              f"{target * 1e6:.0f} | {verdict(value < target)} |")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each measurement")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    ok = time_search(args.repeats)
    ok &= time_spans(args.repeats)
    print(f"\nload average before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
