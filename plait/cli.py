"""The `plait` command: `plait run` starts a script on N ranks, `plait demo` runs the MNIST CNN demo."""

from __future__ import annotations

import argparse
import sys

from plait import launch

__all__ = ["main", "build_parser"]

DEMO_EPILOG = (
    "Any other option goes to every rank's plait.demo: --data DIR (MNIST IDX files; default: "
    "sklearn's 8x8 digits), --epochs, --batch-size, --microbatches, --lr, --seed. "
    "See `python -m plait.demo --help`."
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait", description="Train an unmodified PyTorch model as a pipeline over several processes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,demo}")

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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "run":
        if rest:
            parser.error(f"unrecognized arguments before the script: {' '.join(rest)}")
        start, target, target_args = (launch.run_module if args.module else launch.run,
                                      args.script, args.script_args)
    else:
        # demo: check the demo's own options here, once, rather than on every rank. Imported
        # here so that `plait run` does not import the model code.
        from plait import demo

        demo.parse_args(rest, prog="plait demo")
        start, target, target_args = launch.run_module, "plait.demo", rest
    try:
        return start(target, target_args, args.nproc, args.max_restarts,
                     args.nnodes, args.node_rank, args.master_addr, args.master_port)
    except ValueError as err:  # a bad launch option (LaunchSpec says which and why)
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
