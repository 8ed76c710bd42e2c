"""The paper's MNIST experiment (its Tables 1-2): time, speedup and test accuracy over a grid of
pipeline partitions x data-parallel groups.

The setup is the paper's (section 4.2): its CNN (`plait.cli.demo.PaperCNN`), global batch 1000 cut
into 10 micro-batches of 100, Adam, the 1F1B schedule; 1-3 partitions (pipeline stages) x 1-6
data-parallel groups, every cell with pp x dp <= --max-ranks. The data is the MNIST test set
(first 8,000 images to train, last 2,000 to test, see plait.cli.datasets.mnist_split).

Driver (the default): for each cell, start

    python -m plait.cli run -n pp*dp examples/paper_tables.py --worker --pp P --dp D ...

collect each cell's result, print Table 1 (time), Table 2 (speedup over 1 partition x 1 group)
and the test accuracy in the paper's layout beside the paper's numbers, and write
OUT/results.csv and OUT/speedup.png (the plot needs matplotlib: pip install matplotlib).

Worker (--worker, on every rank of one cell): train, evaluate, and rank 0 writes a JSON result.
Every rank gets --threads CPU threads (default 1): one rank is one of the paper's nodes.

    python examples/paper_tables.py [--epochs 1] [--repeats 1] [--max-ranks 6] [--data DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import plait
from plait.cli import datasets
from plait.cli.demo import DEFAULTS, PaperCNN

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "mnist"  # ../shared/data/mnist from the repo root
DEFAULT_OUT = Path("runs") / "paper_tables"
BATCH = 1000  # the paper's global batch
MICROBATCHES = 10  # ... cut into 10 micro-batches of 100
PAPER_EPOCHS = 5
LR = DEFAULTS["mnist"].lr  # Adam; see plait/demo.py for why 4x Keras' 1e-3
PARTITIONS = (1, 2, 3)
DP_GROUPS = (1, 2, 3, 4, 5, 6)

# The paper's Table 1 (seconds for 5 epochs) and Table 2 (speedup over 1 partition x 1 group),
# on the Tianhe new-generation supercomputer's MT-3000 nodes (section 4.1). Keyed (dp, pp).
PAPER_TIME_S = {
    (1, 1): 670.25, (1, 2): 608.08, (1, 3): 589.76,
    (2, 1): 411.93, (2, 2): 338.44, (2, 3): 334.52,
    (3, 1): 241.91, (3, 2): 234.05, (3, 3): 231.09,
    (4, 1): 183.48, (4, 2): 184.11, (4, 3): 186.40,
    (5, 1): 150.08, (5, 2): 157.52, (5, 3): 156.86,
    (6, 1): 125.93, (6, 2): 135.25, (6, 3): 138.91,
}
PAPER_SPEEDUP = {
    (1, 1): 1.00, (1, 2): 1.10, (1, 3): 1.13,
    (2, 1): 1.62, (2, 2): 1.98, (2, 3): 2.00,
    (3, 1): 2.77, (3, 2): 2.86, (3, 3): 2.90,
    (4, 1): 3.65, (4, 2): 3.64, (4, 3): 3.59,
    (5, 1): 4.46, (5, 2): 4.25, (5, 3): 4.27,
    (6, 1): 5.32, (6, 2): 4.95, (6, 3): 4.82,
}
PAPER_MIN_ACCURACY = 0.97  # "every trained model reaches at least 97% on the MNIST test set"

CSV_FIELDS = ["pp", "dp", "ranks", "epochs", "threads_per_rank", "repeats", "train_s",
              "train_s_min", "train_s_max", "speedup",
              "test_accuracy", "test_loss", "train_loss", "setup_s", "cell_wall_s",
              "load1_before", "load1_after", "other_cores", "steal_cores", "paper_time_s_5_epochs",
              "paper_speedup"]


# -- worker: one cell, on every rank ---------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    x_train, y_train, x_test, y_test = datasets.mnist_split(args.data)  # (8000, 1, 28, 28), ...
    torch.manual_seed(args.seed)
    net = PaperCNN(28)
    model = plait.Model(
        net,
        config=plait.Config(num_stages=args.pp, dp=args.dp, num_microbatches=MICROBATCHES,
                            schedule="1f1b", seed=args.seed),
        optimizer=lambda params: torch.optim.Adam(params, lr=LR),  # state for this stage only
        loss=nn.CrossEntropyLoss(),
        metrics=["accuracy"],
    )
    # capture and split outside the timed part: the paper times training
    start = time.perf_counter()
    model.build(x_train[:BATCH])
    setup_s = _slowest(time.perf_counter() - start)  # its all-reduce lines the ranks up for fit

    start = time.perf_counter()
    history = model.fit(x_train, y_train, epochs=args.epochs, batch_size=BATCH, shuffle=True, verbose=0)
    train_s = _slowest(time.perf_counter() - start)
    result = model.evaluate(x_test, y_test, batch_size=BATCH)

    if model.rank == 0:
        Path(args.result).write_text(json.dumps({
            "pp": model.plan.num_stages, "dp": model.plan.dp, "ranks": model.plan.world_size,
            "epochs": args.epochs, "threads_per_rank": args.threads,
            "layers_per_stage": list(model.plan.layers_per_stage),
            "train_s": train_s, "setup_s": setup_s,
            "train_loss": history.history["loss"][-1],
            "test_loss": result["loss"], "test_accuracy": result["accuracy"],
        }))
    return 0


def _slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (all ranks must call this together)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# -- driver: the grid ------------------------------------------------------------------------------


def cells(max_ranks: int, partitions: tuple[int, ...], groups: tuple[int, ...]) -> list[tuple[int, int]]:
    """(pp, dp) of every cell that fits in `max_ranks` ranks, in table order (column by column)."""
    return [(pp, dp) for pp in partitions for dp in groups if pp * dp <= max_ranks]


def run_cell(args: argparse.Namespace, pp: int, dp: int, out: Path) -> dict[str, float]:
    """Start one cell's ranks through `plait run` and return its result with the load around it."""
    result = out / "cells" / f"pp{pp}_dp{dp}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "plait.cli", "run", "-n", str(pp * dp), str(Path(__file__).resolve()),
               "--worker", "--pp", str(pp), "--dp", str(dp), "--epochs", str(args.epochs),
               "--seed", str(args.seed), "--threads", str(args.threads), "--data", str(args.data),
               "--result", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}  # plait run keeps a set value
    load_before = os.getloadavg()[0]
    cpu_before, mine_before = machine_cpu_s(), children_cpu_s()
    start = time.perf_counter()
    done = subprocess.run(command, env=env, timeout=args.cell_timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    cpu_after, mine_after = machine_cpu_s(), children_cpu_s()
    if done.returncode != 0 or not result.is_file():
        sys.exit(f"cell pp={pp} dp={dp} failed (exit code {done.returncode}); its output:\n{done.stdout}\n"
                 f"command: {' '.join(command)}")
    row = json.loads(result.read_text())
    row.update(cell_wall_s=wall, load1_before=load_before, load1_after=os.getloadavg()[0])
    if cpu_before and cpu_after:  # cores kept busy by everything but this cell, and stolen by the host
        busy, steal = (a - b for a, b in zip(cpu_after, cpu_before))
        row.update(other_cores=max(0.0, busy - (mine_after - mine_before)) / wall, steal_cores=steal / wall)
    return row


def machine_cpu_s() -> tuple[float, float] | None:
    """(busy, stolen) CPU seconds of the whole machine since boot, from /proc/stat (Linux only)."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields  # in clock ticks (proc(5))
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def children_cpu_s() -> float:
    """CPU seconds of this driver's finished children (the cells' launcher and ranks)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def median_run(cell_runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median training time (the lower one of an even count), plus the spread
    and the load over all runs."""
    ordered = sorted(cell_runs, key=lambda r: r["train_s"])
    return {**ordered[(len(ordered) - 1) // 2], "repeats": len(ordered),
            "train_s_min": ordered[0]["train_s"], "train_s_max": ordered[-1]["train_s"],
            "load1_before": min(r["load1_before"] for r in cell_runs),
            "load1_after": max(r["load1_after"] for r in cell_runs),
            **{k: max(r[k] for r in cell_runs) for k in ("other_cores", "steal_cores") if k in ordered[0]}}


def print_tables(rows: dict[tuple[int, int], dict[str, float]], epochs: int) -> None:
    """Table 1 (time), Table 2 (speedup) and test accuracy, ours beside the paper's."""
    dps = sorted({dp for _, dp in rows})
    pps = sorted({pp for pp, _ in rows})

    def table(title: str, ours: dict[tuple[int, int], float], paper: dict[tuple[int, int], float],
              fmt: str) -> None:
        head = "".join(f"{f'{pp} part.':>9s}" for pp in pps)
        print(f"\n{title}\n{'DP groups':>10s} |{head} |{head if paper else ''}")
        for dp in dps:
            mine = "".join(f"{ours[(dp, pp)]:9{fmt}}" if (dp, pp) in ours else f"{'-':>9s}" for pp in pps)
            theirs = "".join(f"{paper[(dp, pp)]:9{fmt}}" if (dp, pp) in paper else f"{'-':>9s}" for pp in pps)
            print(f"{dp:>10d} |{mine} |{theirs if paper else ''}")

    time_s = {(dp, pp): r["train_s"] for (pp, dp), r in rows.items()}
    base = rows.get((1, 1), {}).get("train_s")
    speedup = {k: base / t for k, t in time_s.items()} if base else {}
    accuracy = {(dp, pp): r["test_accuracy"] for (pp, dp), r in rows.items()}
    table(f"Table 1: training time, seconds for {epochs} epoch(s)   | ours | the paper's, "
          f"{PAPER_EPOCHS} epochs", time_s, PAPER_TIME_S, ".1f")
    if speedup:
        table("Table 2: speedup over 1 partition x 1 DP group         | ours | the paper's",
              speedup, PAPER_SPEEDUP, ".2f")
    table(f"Test accuracy (last 2,000 MNIST test images)   | ours | the paper's: >= "
          f"{PAPER_MIN_ACCURACY:.2f} everywhere", accuracy, {}, ".4f")


def write_csv(rows: dict[tuple[int, int], dict[str, float]], path: Path) -> None:
    base = rows.get((1, 1), {}).get("train_s")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for (pp, dp), r in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
            writer.writerow({**r, "speedup": base / r["train_s"] if base else "",
                             "paper_time_s_5_epochs": PAPER_TIME_S.get((dp, pp), ""),
                             "paper_speedup": PAPER_SPEEDUP.get((dp, pp), "")})


def plot(rows: dict[tuple[int, int], dict[str, float]], path: Path, title: str) -> None:
    """Speedup (ours solid, the paper's dashed) and test accuracy against DP groups, a line per
    partition count."""
    import matplotlib  # checked in main()

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows.get((1, 1), {}).get("train_s")
    cores = os.cpu_count() or 1
    fig, (ax_s, ax_a) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [3, 2]})
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    for pp in sorted({pp for pp, _ in rows}):
        dps = sorted(dp for p, dp in rows if p == pp)
        color = colors.get(pp, None)
        label = f"{pp} partition{'s' if pp > 1 else ''}"
        if base:
            ax_s.plot(dps, [base / rows[(pp, dp)]["train_s"] for dp in dps], "o-", color=color,
                      lw=2, label=f"ours, {label}")
        paper = [dp for dp in DP_GROUPS if (dp, pp) in PAPER_SPEEDUP]
        ax_s.plot(paper, [PAPER_SPEEDUP[(dp, pp)] for dp in paper], "s--", color=color, alpha=0.45,
                  label=f"paper, {label}")
        ax_a.plot(dps, [100 * rows[(pp, dp)]["test_accuracy"] for dp in dps], "o-", color=color,
                  lw=2, label=label)
    if base:  # our speedups as numbers, in the table's layout, under the legend (left of the lines)
        pps = sorted({pp for pp, _ in rows})
        lines = ["ours    " + " ".join(f"{pp}part" for pp in pps)] + [
            f"{dp} DP   " + " ".join(f"{base / rows[(pp, dp)]['train_s']:5.2f}" if (pp, dp) in rows
                                     else f"{'-':>5s}" for pp in pps)
            for dp in sorted({dp for _, dp in rows})
        ]
        ax_s.text(0.03, 0.69, "\n".join(lines), transform=ax_s.transAxes, ha="left", va="top",
                  family="monospace", fontsize=7.5,
                  bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.8"})
    ax_s.plot(DP_GROUPS, DP_GROUPS, ":", color="grey", label="linear in DP groups")
    ax_s.axhline(cores, color="red", lw=1, label=f"this machine's {cores} cores")
    ax_s.set(xlabel="data-parallel groups", ylabel="speedup over 1 partition x 1 group",
             xticks=DP_GROUPS, ylim=(0, max(DP_GROUPS) + 0.5),
             title="Table 2: speedup (ours: solid; the paper's: dashed)")
    ax_s.grid(alpha=0.3)
    ax_s.legend(fontsize=8, ncol=2, loc="upper left")
    ax_a.axhline(100 * PAPER_MIN_ACCURACY, color="grey", ls=":", label="the paper's floor, 97%")
    ax_a.set(xlabel="data-parallel groups", ylabel="test accuracy (%)", xticks=DP_GROUPS,
             title="test accuracy (last 2,000 MNIST test images)")
    ax_a.grid(alpha=0.3)
    ax_a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def driver(args: argparse.Namespace) -> int:
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401  # only the plot needs it; fail before the long run
        except ImportError:
            sys.exit("paper_tables.py: the plot needs matplotlib, which is not installed: "
                     "pip install matplotlib (or pass --no-plot)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = cells(args.max_ranks, PARTITIONS, DP_GROUPS)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
               f"{args.threads} thread(s) per rank")
    print(f"paper_tables: {len(grid)} cells (pp x dp <= {args.max_ranks} ranks), {args.epochs} "
          f"epoch(s) each (the paper: {PAPER_EPOCHS}; --epochs to change), batch {BATCH} in "
          f"{MICROBATCHES} micro-batches, Adam lr {LR:g}, 1f1b; {machine}", flush=True)
    # Repeats go round the whole grid, so a spell of load from elsewhere hits several cells
    # a little rather than one cell a lot; each cell reports its median run.
    runs: dict[tuple[int, int], list[dict[str, float]]] = {cell: [] for cell in grid}
    for repeat in range(args.repeats):
        for pp, dp in grid:
            runs[(pp, dp)].append(r := run_cell(args, pp, dp, out))
            print(f"  [{repeat + 1}/{args.repeats}] pp={pp} dp={dp}: train {r['train_s']:7.1f} s, "
                  f"test accuracy {r['test_accuracy']:.4f}, load {r['load1_before']:.1f} -> "
                  f"{r['load1_after']:.1f}, other jobs {r.get('other_cores', float('nan')):.2f} "
                  f"cores", flush=True)
    rows = {cell: median_run(cell_runs) for cell, cell_runs in runs.items()}
    print_tables(rows, args.epochs)
    if args.repeats > 1:
        print(f"(each cell: the median of {args.repeats} runs; min and max in results.csv)")
    loads = [r[k] for cell_runs in runs.values() for r in cell_runs for k in ("load1_before", "load1_after")]
    others = [r["other_cores"] for cell_runs in runs.values() for r in cell_runs if "other_cores" in r]
    print(f"\nmachine: {machine}; 1-minute load average during the grid (this grid's ranks "
          f"included): {min(loads):.1f}-{max(loads):.1f}" + (
              f"; other jobs kept {min(others):.2f}-{max(others):.2f} cores busy (mean "
              f"{sum(others) / len(others):.2f}) while cells ran" if others else ""))
    write_csv(rows, out / "results.csv")
    print(f"wrote {out / 'results.csv'}")
    if not args.no_plot:
        plot(rows, out / "speedup.png", f"PaperCNN on MNIST, {args.epochs} epoch(s) per cell, batch "
             f"{BATCH} in {MICROBATCHES} micro-batches; {machine}")
        print(f"wrote {out / 'speedup.png'}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1,
                        help=f"epochs per cell (default: 1, so the grid fits in minutes on 2 cores; "
                             f"the paper: {PAPER_EPOCHS})")
    parser.add_argument("--max-ranks", type=int, default=6,
                        help="run every cell with partitions x DP groups <= this (default: 6)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA,
                        help="folder with the MNIST test set as IDX files (default: ../shared/data/mnist "
                             "from the repository root)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"results folder (default: {DEFAULT_OUT}/)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every cell, round the grid; each cell reports its median (default: 1)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="weights and shuffling (default: 0)")
    parser.add_argument("--cell-timeout", type=float, default=3600.0, help="seconds per cell (default: 3600)")
    parser.add_argument("--no-plot", action="store_true", help="skip speedup.png (no matplotlib needed)")
    # worker mode: set by the driver
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("epochs", "max_ranks", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    try:
        datasets.mnist_files(args.data)
    except FileNotFoundError as err:
        parser.error(f"--data: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
