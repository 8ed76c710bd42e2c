"""The `plait device` command: measure this machine's GPU into a device file for `plait plan`.

    plait device --like a100-80gb -o mine.json     # on a machine with the GPU
    plait plan --gpt ... --devices 512 --device mine.json

Times the GPU here (`plait.cli.gpu_probe`: its best matmul, copy bandwidth, layer norm and
kernel gap) and writes the preset `--like` with those figures put in, as JSON
(`Device.to_dict`). The peak, the data sheet's bandwidth and the links stay the preset's: edit the
file where your cluster's differ. Prints each measured figure beside the preset's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_device_command", "run_device"]

DESCRIPTION = (
    "Measure this machine's GPU (best matmul rate, copy bandwidth, layer norm throughput, the gap a kernel "
    "costs) and write the preset --like with those figures as a device file for `plait plan --device FILE.json`. "
    "The peak, the data sheet's bandwidth and the links between GPUs stay the preset's."
)


def add_device_command(commands: Any) -> None:
    """Register `plait device` on the CLI's subparsers."""
    parser = commands.add_parser("device", help="measure this machine's GPU into a device file for plait plan",
                                 description=DESCRIPTION)
    parser.add_argument("--like", required=True, metavar="PRESET",
                        help="the GPU preset to start from: a100-40gb, a100-80gb, h100-80gb, h200-141gb, v100-16gb, "
                             "mi250x, or a device FILE.json")
    parser.add_argument("-o", "--output", required=True, metavar="FILE.json", help="the device file to write")
    parser.add_argument("--runs", type=int, default=3, metavar="K",
                        help="whole measurements; the best of them is kept (default: 3)")
    parser.add_argument("--reps", type=int, default=10, metavar="N",
                        help="timed calls per figure, their median taken (default: 10)")


def _rows(like: Any, mine: Any) -> list[tuple[str, str, str]]:
    """(figure, preset's, measured) for what the probe measures."""
    def rate(dev: Any) -> str:
        return f"{dev.gemm_flops / 1e12:.1f} TFLOP/s at {tuple(dev.gemm_shape)}" if dev.gemm_flops else "none (peak)"

    def norm(dev: Any) -> str:
        f, b = dev.norm_bandwidth
        return f"{f / 1e12:.2f} / {b / 1e12:.2f} TB/s" if f else "none (copy)"

    return [("SMs", str(like.sms), str(mine.sms)),
            ("memory", f"{like.memory_bytes / 2**30:.1f} GiB", f"{mine.memory_bytes / 2**30:.1f} GiB"),
            ("best matmul", rate(like), rate(mine)),
            ("copy bandwidth", f"{like.bandwidth / 1e12:.2f} TB/s", f"{mine.bandwidth / 1e12:.2f} TB/s"),
            ("layer norm fwd / bwd", norm(like), norm(mine)),
            ("fixed time per layer and pass", f"{like.kernel_overhead_s * 1e6:.1f} us", f"{mine.kernel_overhead_s * 1e6:.1f} us")]


def run_device(args: argparse.Namespace) -> int:
    from plait.cost.devices import device
    from plait.cli.gpu_probe import measure_device

    like = device(args.like)
    mine = measure_device(like, runs=args.runs, reps=args.reps)
    Path(args.output).write_text(json.dumps(mine.to_dict(), indent=1) + "\n")
    print(f"{mine.name}: measured (best of {args.runs} runs, medians of {args.reps} calls)")
    print(f"  {'':<30} {'preset ' + like.name:<34} measured")
    for what, theirs, ours in _rows(like, mine):
        print(f"  {what:<30} {theirs:<34} {ours}")
    print(f"wrote {args.output}: plan with `plait plan ... --device {args.output}`")
    return 0
