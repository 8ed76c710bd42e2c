"""The `plait` command: `run` a script on N ranks, the `demo`, `timeline`/`simulate` charts, `export`, `plan`, `device`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from plait.errors import PlaitError
from plait.job import launch
from plait.config.run_options import run_options_env

__all__ = ["main", "build_parser"]

DEMO_EPILOG = (
    "Any other option goes to every rank's plait.cli.demo: --data DIR (MNIST IDX files; default: "
    "sklearn's 8x8 digits), --epochs, --batch-size, --microbatches, --lr, --seed. "
    "See `python -m plait.cli.demo --help`."
)
TIMELINE_DESCRIPTION = (
    "Draw one training step of a run traced with plait.Config(trace_dir=TRACE_DIR) as two Gantt "
    "charts on one time axis: planned (the schedule simulated with the forward, backward and "
    "weight-gradient times measured in that step) above measured, each with its bubble fraction. "
    "Each TRACE_DIR/rank<r>.json also opens in https://ui.perfetto.dev (all ranks at once: "
    "--perfetto)."
)


def _add_launch_options(parser: argparse.ArgumentParser, default_nproc: int) -> None:
    parser.add_argument("-n", "--nproc", type=int, default=default_nproc, metavar="N",
                        help=f"ranks (processes) on this node (default: {default_nproc})")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart all ranks up to K times after a failure (default: 0)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default: 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (default: 0)")
    parser.add_argument("--master-addr", default=None, metavar="HOST",
                        help="address of node 0, the same on every node; needed with --nnodes > 1 "
                             f"(one node listens on {launch.LOCALHOST} only)")
    parser.add_argument("--master-port", type=int, default=None, metavar="PORT",
                        help="a free port on node 0, the same on every node; needed with --nnodes > 1 "
                             "(default on one node: any free port)")
    parser.add_argument("--replan", action="store_true",
                        help="re-partition once when the first steps are more than 15%% off the "
                             "planner's prediction (for every rank whose Config leaves replan "
                             "open; see plait.config.run_options)")


def _count(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _duration(text: str) -> float:
    """An argparse type: a time in ms, >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a time in ms >= 0, such as 1.5, got {text!r}")
    return value


def _add_chart_commands(commands: Any) -> None:
    timeline = commands.add_parser(
        "timeline", help="draw planned vs measured Gantt charts of a traced step",
        description=TIMELINE_DESCRIPTION)
    timeline.add_argument("trace_dir", metavar="TRACE_DIR", help="the run's Config.trace_dir")
    timeline.add_argument("-o", "--output", required=True, metavar="OUT.png", help="the picture")
    timeline.add_argument("--step", type=int, default=None, metavar="K",
                          help="the training step to draw (default: the last complete one; the "
                               "first includes warm-up)")
    timeline.add_argument("--perfetto", default=None, metavar="OUT.json",
                          help="also write every rank's spans into one Chrome trace file, to see "
                               "all ranks at once in https://ui.perfetto.dev")

    simulate = commands.add_parser(
        "simulate", help="time a schedule on paper: step time, bubble, peak activations",
        description="Simulate one training step of a pipeline schedule with fixed times per "
                    "micro-batch and stage; print its step time, bubble fraction and peak "
                    "activations per rank, and with -o draw it as a Gantt chart.")
    simulate.add_argument("--schedule", default="1f1b", help="schedule name (default: 1f1b)")
    simulate.add_argument("--stages", type=_count, required=True, metavar="P",
                          help="pipeline stages, one rank each")
    simulate.add_argument("--microbatches", type=_count, required=True, metavar="M",
                          help="micro-batches per step")
    simulate.add_argument("--virtual-stages", type=_count, default=1, metavar="V",
                          help="model chunks per rank, for --schedule interleaved (default: 1)")
    for flag, what, default in (("--t-f", "a forward", None),
                                ("--t-b", "a backward (the input gradient, when split)", None),
                                ("--t-w", "a weight gradient (split backward only)", 0.0),
                                ("--t-comm", "a send between ranks", 0.0)):
        simulate.add_argument(flag, type=_duration, required=default is None, default=default,
                              metavar="MS", help=f"time of {what} of one micro-batch on one "
                              f"stage (with V: on all its chunks), ms"
                              + ("" if default is None else " (default: 0)"))
    simulate.add_argument("-o", "--output", default=None, metavar="OUT.png",
                          help="also draw the step as a Gantt chart")


def _timeline(args: argparse.Namespace) -> int:
    from plait.cli import timeline  # imported here: only these commands need it, and matplotlib

    trace = timeline.load(args.trace_dir)
    step = trace.resolve_step(args.step)
    out = timeline.draw_measured(trace, args.output, step)
    print(f"step {step}: measured bubble {timeline.bubble_fraction(trace, step):.1%}; "
          f"wrote {out}")
    if args.perfetto is not None:
        print(f"wrote {timeline.merge(args.trace_dir, args.perfetto)}")
    return 0


def _runs(values: list[float], listed: int = 16) -> str:
    """Per-rank numbers, all of them up to `listed` ranks; beyond, equal neighbours as ranges:
    `4 (ranks 0-2496), 3 (rank 2497), ...`."""
    if len(values) <= listed:
        return ", ".join(f"{v:g}" for v in values)
    parts, start = [], 0
    for r in range(1, len(values) + 1):
        if r == len(values) or values[r] != values[start]:
            ranks = f"rank {start}" if r - 1 == start else f"ranks {start}-{r - 1}"
            parts.append(f"{values[start]:g} ({ranks})")
            start = r
    shown = parts if len(parts) <= listed else parts[: listed - 1] + [f"... {len(parts) - listed + 1} more"]
    return ", ".join(shown) + f"; max {max(values):g}"


def _simulate(args: argparse.Namespace) -> int:
    from plait.schedule import simulate

    sim = simulate(args.schedule, args.stages, args.microbatches, args.t_f, args.t_b,
                   t_w=args.t_w, t_comm=args.t_comm, num_virtual_stages=args.virtual_stages)
    peaks = _runs(sim.peak_activations)
    print(f"{args.schedule}: p={args.stages} stages, m={args.microbatches} micro-batches, "
          f"v={args.virtual_stages} chunk(s) per rank\n"
          f"step time         {sim.step_time:g} ms\n"
          f"bubble fraction   {sim.bubble_fraction:.1%}\n"
          f"peak activations  {peaks} (micro-batches held at once, per rank)")
    if args.output is not None:
        from plait.cli import timeline

        print(f"wrote {timeline.draw_simulation(sim, args.output, schedule=args.schedule)}")
    return 0


def _add_export_command(commands: Any) -> None:
    export = commands.add_parser(
        "export", help="write a checkpoint's model as a plain state-dict file",
        description="Write the model of a plait checkpoint as one plain state dict, with the names "
                    "of net.state_dict(): OUT.safetensors in that format, anything else with "
                    "torch.save, so net.load_state_dict(torch.load(OUT, weights_only=True)) loads it.")
    export.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint directory (its latest complete checkpoint) or one step-NNNNNN directory")
    export.add_argument("-o", "--output", required=True, metavar="OUT", help="the file to write")


def _export(args: argparse.Namespace) -> int:
    from plait.checkpoint.parts import export

    ckpt = export(args.checkpoint, args.output)
    print(f"wrote {args.output}: the model of step {ckpt.step} ({ckpt.path})")
    return 0


def _device(args: argparse.Namespace) -> int:
    from plait.cli.device import run_device

    return run_device(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait", description="Train an unmodified PyTorch model as a pipeline over several processes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,demo,timeline,simulate,export,plan,device}")

    run = commands.add_parser(
        "run", help="run a training script on N ranks",
        description="Run `python script.py args...` on N ranks through torch's elastic launcher. "
                    "Everything after the script goes to the script. On several nodes, run the same "
                    "command on each with its own --node-rank.")
    _add_launch_options(run, default_nproc=1)
    run.add_argument("-m", "--module", action="store_true",
                     help="the target is a module name, run as `python -m module`")
    run.add_argument("script", help="the training script (or module, with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    demo = commands.add_parser(
        "demo", help="train the paper's MNIST CNN on 2 pipeline stages",
        description="Train the paper's MNIST CNN as a 2-stage pipeline on --nproc local ranks.",
        epilog=DEMO_EPILOG, allow_abbrev=False)
    _add_launch_options(demo, default_nproc=2)
    _add_chart_commands(commands)
    from plait.cli.plan_command import add_plan_command

    add_plan_command(commands)
    _add_export_command(commands)
    from plait.cli.device import add_device_command

    add_device_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "plan":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from plait.cli.plan_command import run_plan

        try:
            return run_plan(args)
        except (PlaitError, ValueError, OSError, ImportError) as err:
            print(f"plait plan: error: {err}", file=sys.stderr)
            return 1
    if args.command in ("timeline", "simulate", "export", "device"):
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        try:
            return {"timeline": _timeline, "simulate": _simulate, "export": _export, "device": _device}[args.command](args)
        except (PlaitError, ValueError, OSError, ImportError) as err:
            print(f"plait {args.command}: error: {err}", file=sys.stderr)
            return 1
    if args.command == "run":
        if rest:
            parser.error(f"unrecognized arguments before the script: {' '.join(rest)}")
        module, target, target_args = args.module, args.script, args.script_args
    else:
        # demo: check the demo's own options here, once, rather than on every rank. Imported
        # here so that `plait run` does not import the model code.
        from plait.cli import demo

        demo.parse_args(rest, prog="plait demo")
        module, target, target_args = True, "plait.cli.demo", rest
    if args.replan:
        os.environ.update(run_options_env(replan=True))  # the ranks inherit it (plait.config.run_options)
    try:
        spec = launch.LaunchSpec(target, tuple(target_args), args.nproc, module, args.max_restarts,
                                 args.nnodes, args.node_rank, args.master_addr, args.master_port)
    except ValueError as err:  # a bad launch option (LaunchSpec says which and why)
        parser.error(str(err))
    return launch.start(spec)


if __name__ == "__main__":
    sys.exit(main())
