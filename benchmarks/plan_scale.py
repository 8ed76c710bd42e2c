"""The planner and the simulator at the paper's scale: wall time and peak memory against the targets.

In one process: `plait plan`'s search (`search_tp`, every tp the device preset allows) for the
paper's GPT -- vocabulary 13,312, hidden 1,024, 16 heads, sequence 1,024, 7,500 layers -- on
10,000 devices with a global batch of 16; then `plait.schedule.simulate` of 1F1B on 2,500
stages with the paper's 4 micro-batches. Each is timed with `time.perf_counter`; the planner's
peak memory is the process's resident peak (`resource.getrusage` ru_maxrss, imports included).
Targets: the plan in <= 60 s and <= 4 GiB, the simulation in <= 10 s.

    python benchmarks/plan_scale.py [--device v100-16gb] [--layers 7500] [--devices 10000]
                                    [--stages 2500] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from plait.cost.analytic import gpt_costs, gpt_tp_shares, parse_gpt
from plait.cost.memory import optimizer_state_factor
from plait.cost.prediction import Cluster
from plait.cost.devices import device
from plait.search.search import SearchSpace
from plait.search.tp_degree import search_tp, tp_degrees
from plait.schedule import simulate

GIB = 2.0**30


def _line(what: str, value: float, unit: str, target: float) -> tuple[str, bool]:
    ok = value <= target
    return (f"{what:<34} {value:10.2f} {unit:<4} target <= {target:g} {unit:<4} "
            f"ratio {value / target:5.2f}  {'PASS' if ok else 'FAIL'}"), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="v100-16gb")
    parser.add_argument("--layers", type=int, default=7500)
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--stages", type=int, default=2500)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)

    # -- the plan --------------------------------------------------------------------------
    spec = parse_gpt(f"layers={args.layers},hidden=1024,heads=16,seq=1024,vocab=13312")
    dev = device(args.device)
    cluster = Cluster(dev.network, dev.usable_memory(), optimizer_state_factor("adam", dev.dtype_bytes))
    tps = tp_degrees(args.devices, dev.network.devices_per_node)
    start = time.perf_counter()
    found = search_tp(gpt_costs(spec, dev), {t: gpt_tp_shares(spec, dev, t) for t in tps if t > 1},
                      args.devices, args.batch, cluster, SearchSpace())
    plan_s = time.perf_counter() - start
    plan_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux
    best = found[0]
    st = best.setting
    print(f"plan: GPT {args.layers} layers on {args.devices} x {dev.name}, batch {args.batch}, tp {list(tps)}: "
          f"pp={st.pp} dp={st.dp} tp={best.tp} m={st.num_microbatches} {st.schedule} "
          f"recompute={st.recompute} zero={st.zero} batch_weight_grads={st.batch_weight_grads}, step {best.step_time_s:.4f} s ({best.prediction.method if best.prediction else 'infeasible'})")

    # -- the simulation --------------------------------------------------------------------
    start = time.perf_counter()
    sim = simulate("1f1b", args.stages, args.microbatches, 1.0, 2.0)
    sim_s = time.perf_counter() - start
    print(f"simulate: 1f1b, {args.stages} stages, {args.microbatches} micro-batches: "
          f"step {sim.step_time:g}, bubble {sim.bubble_fraction:.1%}")

    rows = [_line("plan: wall time", plan_s, "s", 60.0),
            _line("plan: peak resident memory", plan_rss, "GiB", 4.0),
            _line("simulate: wall time", sim_s, "s", 10.0)]
    for text, _ in rows:
        print(text)
    return 0 if all(ok for _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
