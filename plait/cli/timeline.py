"""Timelines of pipeline steps: read a trace directory, measure the bubble, draw the steps."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from plait.cli.gantt import LANES, Panel, render
from plait.plan.mesh import Mesh
from plait.runtime.tracer import FORMAT_VERSION

__all__ = ["Span", "Trace", "load", "merge", "bubble_fraction", "stage_times", "send_times",
           "transfer_time", "plan", "draw_measured", "draw_simulation"]

COMPUTE_OPS = ("F", "B", "W")  # what a simulation plans; the optimizer is compute it does not


@dataclass(frozen=True)
class Span:
    """One measured span of a rank; times in ms since the earliest span of any rank."""

    rank: int
    stream: str
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)  # compute: step, stage, op, mb

    op = property(lambda self: self.args.get("op"))  # "F", "B", "W", "opt" or None
    step = property(lambda self: self.args.get("step"))


@dataclass(frozen=True)
class Trace:
    """The spans of every rank of one run (`spans[rank]`, by start) and the runtime's meta."""

    trace_dir: Path
    meta: dict[str, Any]
    spans: dict[int, list[Span]]

    @cached_property
    def mesh(self) -> Mesh:
        """Where the run's ranks sat (`Mesh`), from the runtime's meta (a trace written before tp and
        the stages' widths were recorded: tp = 1)."""
        meta = self.meta
        v = int(meta.get("num_virtual_stages", 1))
        pp = int(meta.get("pp") or int(meta.get("num_stages", 1)) // v)
        return Mesh(int(meta.get("world_size") or len(self.spans)), pp, int(meta.get("dp", 1)), int(meta.get("tp", 1)),
                    v, tuple(meta.get("stage_tp", ())), tuple(meta.get("stage_dp", ())))

    @cached_property
    def _by_step(self) -> dict[int, dict[int, list[Span]]]:
        """step -> rank -> the rank's compute spans of that step (one pass over the trace)."""
        steps: dict[int, dict[int, list[Span]]] = {}
        for rank, spans in self.spans.items():
            for s in spans:
                if s.stream == "compute" and s.step is not None:
                    steps.setdefault(s.step, {r: [] for r in self.spans})[rank].append(s)
        return dict(sorted(steps.items()))

    def compute(self, step: int, ops: tuple[str, ...] = COMPUTE_OPS) -> dict[int, list[Span]]:
        """Each rank's compute spans of `step` whose op is in `ops`."""
        ranks = self._by_step.get(step, {r: [] for r in self.spans})
        return {rank: [s for s in spans if s.op in ops] for rank, spans in ranks.items()}

    def complete_steps(self) -> list[int]:
        """Training steps every rank finished: each F has its B, and the optimizer ran if traced."""
        with_optimizer = {r for r, spans in self.spans.items() if any(s.op == "opt" for s in spans)}

        def finished(rank: int, spans: list[Span]) -> bool:
            f, b = ({(s.args.get("stage"), s.args.get("mb")) for s in spans if s.op == op}
                    for op in ("F", "B"))
            return bool(f) and f == b and (rank not in with_optimizer
                                           or any(s.op == "opt" for s in spans))

        return [k for k, ranks in self._by_step.items()
                if all(finished(rank, spans) for rank, spans in ranks.items())]

    def resolve_step(self, step: int | None) -> int:
        """`step`, checked, or (None) the last complete step: the first one includes warm-up."""
        complete = self.complete_steps()
        if step is None and complete:
            return complete[-1]
        if step is None or step not in complete:
            raise ValueError(f"{'no' if step is None else f'step {step} is not a'} complete "
                             f"training step in the trace {self.trace_dir}; complete steps: "
                             f"{complete or 'none (trace at least one whole step)'}")
        return step

    def window(self, step: int) -> tuple[float, float]:
        """From the step's first F/B/W start to its last F/B/W end, over all ranks (ms)."""
        spans = [s for spans in self.compute(step).values() for s in spans]
        return min(s.start for s in spans), max(s.end for s in spans)


def _documents(trace_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> its parsed `rank{r}.json`, each checked to be a plait trace this version reads."""
    fix = "point at the directory given as plait.Config(trace_dir=...): each rank writes one"
    if not trace_dir.is_dir():
        raise FileNotFoundError(f"trace directory {trace_dir} does not exist; {fix}")
    files = sorted((int(m.group(1)), p) for p in trace_dir.iterdir()
                   if (m := re.fullmatch(r"rank(\d+)\.json", p.name)))
    if not files:
        raise ValueError(f"no rank<r>.json files in {trace_dir}; {fix}")
    documents = {}
    for rank, path in files:
        try:
            documents[rank] = document = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); was the run cut short while "
                             f"writing it? Trace the run again") from None
        if not isinstance(document, dict) or "plait" not in document:
            raise ValueError(f"{path} is not a plait trace (no 'plait' metadata); {fix}")
        if document["plait"].get("format", 0) > FORMAT_VERSION:
            raise ValueError(f"{path} has trace format {document['plait'].get('format')}, newer "
                             f"than this plait reads ({FORMAT_VERSION}); upgrade plait")
    return documents


def load(trace_dir: str | Path) -> Trace:
    """Read every `rank{r}.json` that `Config(trace_dir=...)` wrote into `trace_dir`."""
    documents = _documents(Path(trace_dir))
    events = {rank: [e for e in d.get("traceEvents", []) if e.get("ph") == "X"]
              for rank, d in documents.items()}
    origin = min((e["ts"] for es in events.values() for e in es), default=0.0)
    spans = {rank: sorted((Span(rank, e.get("cat", "compute"), e["name"],
                                (e["ts"] - origin) / 1000, (e["ts"] + e["dur"] - origin) / 1000,
                                e.get("args", {})) for e in es), key=lambda s: s.start)
             for rank, es in events.items()}
    meta = {k: v for k, v in documents[min(documents)]["plait"].items() if k != "rank"}
    return Trace(Path(trace_dir), meta, spans)


def merge(trace_dir: str | Path, out_json: str | Path) -> Path:
    """All ranks' events in one Chrome trace, so that Perfetto shows every rank at once."""
    documents = _documents(Path(trace_dir))
    merged = {"traceEvents": [e for d in documents.values() for e in d["traceEvents"]],
              "displayTimeUnit": "ms", "plait": documents[min(documents)]["plait"]}
    Path(out_json).write_text(json.dumps(merged, separators=(",", ":")))
    return Path(out_json)


def _idle_share(rows: list[list[tuple[float, float]]]) -> float:
    """Idle share of all rows between the first start and the last end of any interval."""
    intervals = [iv for row in rows for iv in row]
    if not intervals:
        return 0.0
    t0, t1 = min(a for a, _ in intervals), max(b for _, b in intervals)
    busy = 0.0
    for row in rows:  # the union per row, in case spans of one rank overlap
        end = t0
        for a, b in sorted(row):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
    return 1.0 - busy / (len(rows) * (t1 - t0)) if t1 > t0 else 0.0


def bubble_fraction(trace: Trace, step: int | None = None) -> float:
    """Idle share of all ranks in `step`'s window (its first F/B/W start to its last end).

    Only F, B and W count as work, so the figure compares with a planned one (which has no
    optimizer); a rank with no work in the step counts as idle throughout.
    """
    step = trace.resolve_step(step)
    return _idle_share([[(s.start, s.end) for s in spans]
                        for spans in trace.compute(step).values()])


def stage_times(trace: Trace, step: int | None = None) -> dict[str, list[float]]:
    """Mean time (ms) of each op per stage in `step`: {"F": [stage 0, 1, ...], "B": ..., "W": ...}.

    Averaged over micro-batches and data-parallel replicas; 0.0 where a stage has no such op
    (W, unless the schedule splits the backward: then B is the whole backward).
    """
    step = trace.resolve_step(step)
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    for spans in trace.compute(step).values():
        for s in spans:
            durations[(str(s.op), int(s.args.get("stage", 0)))].append(s.end - s.start)
    num_stages = 1 + max(stage for _, stage in durations)  # a complete step runs every stage
    return {op: [sum(d) / len(d) if (d := durations.get((op, stage))) else 0.0
                 for stage in range(num_stages)] for op in COMPUTE_OPS}


def send_times(trace: Trace, step: int | None = None) -> dict[str, list[float]]:
    """Mean time (ms) a stage spends per micro-batch on posting its sends and receives.

    "F": SF (activations to the next stage) and posting the RF that brings its input; "B": SB
    (gradients to the previous stage) and posting the RB. 0.0 where a stage has none. They never
    block the schedule, but they occupy the rank as compute does.
    """
    step = trace.resolve_step(step)
    totals: dict[tuple[str, int], float] = defaultdict(float)
    for spans in trace.spans.values():
        for s in spans:
            if s.step == step and s.op in ("SF", "SB", "PRF", "PRB"):
                totals[(str(s.op)[-1], int(s.args["stage"]))] += s.end - s.start
    per_stage = defaultdict(int)
    for spans in trace.compute(step, ("F",)).values():
        for s in spans:
            per_stage[int(s.args["stage"])] += 1
    num_stages = len(stage_times(trace, step)["F"])
    return {op: [totals.get((op, stage), 0.0) / max(per_stage[stage], 1)
                 for stage in range(num_stages)] for op in ("F", "B")}


def transfer_time(trace: Trace, step: int | None = None) -> float:
    """Median time (ms) from the end of a send to the end of the receive that was waiting for it.

    Only receives that started before their send ended count: there the receiver's wait shows
    when the message arrived. 0.0 when no receive waited (ranks on one host, one clock).
    """
    step = trace.resolve_step(step)
    mesh = trace.mesh
    sends: dict[tuple[int, str, int, int], Span] = {}
    receives: list[Span] = []
    for spans in trace.spans.values():
        for s in spans:
            if s.step != step:
                continue
            if s.stream == "send" and s.op in ("SF", "SB"):
                sends[(s.rank, str(s.op), int(s.args["stage"]), int(s.args["mb"]))] = s
            elif s.stream == "recv" and s.op in ("RF", "RB"):
                receives.append(s)
    waits = []
    for r in receives:
        stage, mb = int(r.args["stage"]), int(r.args["mb"])
        sender = stage - 1 if r.op == "RF" else stage + 1
        peer = mesh.lane_ranks(r.rank)[sender]  # the rank of that stage on this rank's lane
        sent = sends.get((peer, "SF" if r.op == "RF" else "SB", sender, mb))
        if sent is not None and r.start < sent.end:
            waits.append(max(0.0, r.end - sent.end))
    waits.sort()
    return waits[len(waits) // 2] if waits else 0.0


def plan(trace: Trace, step: int | None = None) -> Any:
    """`plait.schedule.simulate` of the trace's schedule with the per-stage op times of `step`.

    No communication time: the plan is the schedule's own shape at the measured compute speed,
    so its gap to the measurement is what sends, receives and waits cost.
    """
    from plait.schedule import simulate

    step = trace.resolve_step(step)
    meta = trace.meta
    if "schedule" not in meta or "num_stages" not in meta:
        raise ValueError(f"the trace {trace.trace_dir} names no schedule and num_stages in its "
                         f"'plait' metadata, so there is no plan; trace with this plait version")
    v = meta.get("num_virtual_stages", 1)
    times = stage_times(trace, step)  # one time per stage, in stage order: what simulate takes
    microbatches = {s.args.get("mb") for spans in trace.compute(step, ("F",)).values()
                    for s in spans}
    return simulate(meta["schedule"], meta.get("pp") or meta["num_stages"] // v,
                    len(microbatches), times["F"], times["B"], t_w=times["W"],
                    num_virtual_stages=v)


def _row_label(rank: int, stages: set[int], always: bool = False, replica: str = "") -> str:
    """`rank 1`, and under it the stages it runs when there are several (or `always`)."""
    if not stages or (len(stages) == 1 and not always):
        return f"rank {rank}"
    names = ", ".join(map(str, sorted(stages)))
    return f"rank {rank}\nstage{'s' * (len(stages) > 1)} {names}{replica}"


def _sim_panel(sim: Any, schedule: str | None, label: str = "") -> Panel:
    events = list(sim.timeline)
    ranks = sorted({e.rank for e in events})
    v = max(1, len({e.stage_index for e in events}) // max(1, len(ranks)))
    boxes = [(ranks.index(e.rank), e.start, e.end, str(getattr(e.op, "value", e.op)),
              e.stage_index, e.microbatch_index) for e in events]
    peaks = ", ".join(f"{a:g}" for a in getattr(sim, "peak_activations", []))
    title = (f"{label}{schedule or 'schedule'}: p={len(ranks)}, "
             f"m={len({e.microbatch_index for e in events})}, v={v}   step {sim.step_time:.4g} ms"
             f"   bubble {sim.bubble_fraction:.1%}" + (f"   peak activations per rank: {peaks}"
                                                       if peaks else ""))
    return Panel(title, [_row_label(r, {e.stage_index for e in events if e.rank == r})
                         for r in ranks], boxes, max(b[2] for b in boxes))


def _measured_panel(trace: Trace, step: int) -> Panel:
    t0, t1 = trace.window(step)
    work = trace.compute(step, (*COMPUTE_OPS, "opt"))
    stop = max(s.end for spans in work.values() for s in spans)
    panel = Panel("", [], [], t1 - t0)
    meta = trace.meta
    for row, rank in enumerate(sorted(trace.spans)):
        replica = f", replica {trace.mesh.coordinates(rank).replica}" if meta.get("dp", 1) > 1 else ""
        panel.rows.append(_row_label(rank, {s.args["stage"] for s in work[rank]
                                            if "stage" in s.args}, True, replica))
        panel.boxes += [(row, s.start - t0, s.end - t0, str(s.op), s.args.get("stage", -1),
                         s.args.get("mb", 0)) for s in work[rank]]
        panel.lanes += [(row, max(s.start, t0) - t0, min(s.end, stop) - t0, s.stream)
                        for s in trace.spans[rank]
                        if s.stream in LANES and s.end > t0 and s.start < stop]
    m = len({b[5] for b in panel.boxes if b[3] == "F"})
    panel.title = (f"measured: {meta.get('schedule', '?')}, p={meta.get('pp', '?')}, m={m}, "
                   f"v={meta.get('num_virtual_stages', 1)}, {len(panel.rows)} ranks, step {step}"
                   f"   step {stop - t0:.4g} ms   bubble {bubble_fraction(trace, step):.1%}")
    return panel


def draw_simulation(sim: Any, out_png: str | Path, schedule: str | None = None) -> Path:
    """Gantt chart of a `plait.schedule.simulate` result, one row per rank; returns the PNG path."""
    return render([_sim_panel(sim, schedule or getattr(sim, "schedule", None))], out_png)


def draw_measured(trace: Trace, out_png: str | Path, step: int | None = None,
                  planned: bool = True) -> Path:
    """Gantt chart of `step` (default: the last complete one) as measured on every rank.

    With `planned`, the schedule simulated with the step's mean F/B/W times is drawn above it,
    on the same time axis (what `plait timeline` draws).
    """
    step = trace.resolve_step(step)
    panels = [_measured_panel(trace, step)]
    if planned:
        panels.insert(0, _sim_panel(plan(trace, step), trace.meta.get("schedule"), "planned: "))
        panels[0].title += f"   (mean F/B/W of step {step}, no communication)"
    return render(panels, out_png)
