"""Gantt charts of pipeline steps: boxes per rank on a time axis, drawn with matplotlib."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Panel", "render", "LANES"]

# One row per rank. Measured rows hold the compute boxes on top and a thin lane per other stream
# below them; the grey band behind the boxes is the step's window, so the bubble is the grey left:
#
#   rank 0 |[0][1][2][3]        [0] [4] [1] ...   compute (F blue, B orange, W purple, opt grey)
#          |  -   -   -    ---    -              recv / send / wait / allreduce lanes

_COLOURS = {"F": "#3b6ea8", "B": "#e8822a", "W": "#8e5ea2", "opt": "#7f7f7f"}
_NAMES = {"F": "forward", "B": "backward", "W": "weight grad", "opt": "optimizer"}
LANES = {"recv": "#2ca02c", "send": "#17becf", "wait": "#d62728", "allreduce": "#8c564b"}
_IDLE = "#e6e6e6"


@dataclass
class Panel:
    """One chart: a title, row labels (one row per rank), compute boxes and stream lanes (ms)."""

    title: str
    rows: list[str]
    boxes: list[tuple[int, float, float, str, int, int]]  # row, a, b, op, stage (-1: none), mb
    idle: float  # the grey band behind every row: [0, idle] ms
    lanes: list[tuple[int, float, float, str]] = field(default_factory=list)  # row, a, b, stream


def _shade(colour: str, microbatch: int) -> tuple[float, ...]:
    """Odd micro-batches a lighter tint of the op's colour, so neighbours stand apart."""
    mix = 0.4 if microbatch % 2 else 0.0
    return tuple(c + (1 - c) * mix for c in (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)))


def render(panels: list[Panel], out_png: str | Path) -> Path:
    """Draw the panels one above the other on one time axis and save a PNG."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("drawing a timeline needs matplotlib, which is not installed: "
                          "pip install matplotlib (or pip install 'plait[plot]')") from err
    lanes_used = [s for s in LANES if any(lane[3] == s for p in panels for lane in p.lanes)]
    heights = [len(p.rows) * (0.45 + 0.13 * len(lanes_used) * bool(p.lanes)) + 0.6 for p in panels]
    fig = Figure(figsize=(14, sum(heights) + 0.6), dpi=130, layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    end = 1.005 * max([b[2] for p in panels for b in p.boxes] + [p.idle for p in panels])
    tops = [0.9 - 0.3 * bool(p.lanes) for p in panels]  # compute boxes: y in [r+0.1, r+top]
    hatched = False
    for ax, panel, top in zip(axes, panels, tops):
        box = {"height": top - 0.1, "align": "edge"}
        ax.barh([r + 0.1 for r in range(len(panel.rows))], panel.idle, color=_IDLE, **box)
        stages_on: dict[int, set[int]] = defaultdict(set)
        for row, _, _, _, stage, _ in panel.boxes:
            stages_on[row] |= {stage} if stage >= 0 else set()
        for row, a, b, op, stage, mb in panel.boxes:
            # hatched: the 2nd, 4th, ... stage of a rank that holds several (virtual stages)
            chunk = sorted(stages_on[row]).index(stage) if stage >= 0 else 0
            hatched |= chunk % 2 == 1
            ax.barh(row + 0.1, b - a, left=a, hatch="///" if chunk % 2 else None,
                    color=_shade(_COLOURS.get(op, "#000000"), mb), edgecolor="white", lw=0.8, **box)
        lane_height = (0.95 - top) / max(1, len(lanes_used))
        for row, a, b, stream in panel.lanes:  # at least a sliver wide, so a short one shows
            ax.barh(row + top + 0.02 + lanes_used.index(stream) * lane_height,
                    max(b - a, end * 4e-4), left=a, height=lane_height * 0.8, align="edge",
                    color=LANES[stream])
        ax.set_ylim(len(panel.rows), 0)
        ax.set_yticks([r + (0.1 + top) / 2 for r in range(len(panel.rows))], panel.rows)
        ax.set_title(panel.title, loc="left", fontsize=10)
        ax.grid(axis="x", color="#cccccc", lw=0.5)
        ax.set(axisbelow=True, xlim=(0, end), xlabel="time (ms)" + (
            " since the step's first compute" if panel.lanes else ""))
        ax.tick_params(labelbottom=True)
    fig.draw_without_rendering()  # lays the axes out, so box widths in pixels are known
    for ax, panel, top in zip(axes, panels, tops):
        px_per_ms = ax.get_window_extent().width / end
        for row, a, b, op, _, mb in panel.boxes:
            text = "opt" if op == "opt" else str(mb)
            size = min(8.0, (b - a) * px_per_ms / (0.65 * len(text)) * 72 / fig.dpi)  # pt
            if size >= 5.5:  # else the box is too narrow to read a number in
                dark = op in ("F", "W", "opt") and mb % 2 == 0
                ax.text((a + b) / 2, row + (0.1 + top) / 2, text, ha="center", va="center",
                        fontsize=size, color="white" if dark else "black", clip_on=True)
    ops_used = {b[3] for p in panels for b in p.boxes}
    handles = [Patch(color=_COLOURS[op], label=_NAMES[op]) for op in _COLOURS if op in ops_used]
    handles += [Patch(color=_IDLE, label="idle (bubble)")]
    if hatched:
        handles += [Patch(facecolor="white", edgecolor="#555555", hatch="///",
                          label="2nd, 4th, ... chunk of a rank")]
    handles += [Patch(color=LANES[s], label=s) for s in lanes_used]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False,
               fontsize=9, title="number in a box: micro-batch; lighter: odd micro-batch",
               title_fontsize=8)
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return Path(out_png)


