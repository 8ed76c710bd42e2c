"""The `plait plan` command: plan a described GPT (no profiling) or a user's model (profiled here).

    plait plan --gpt layers=48,hidden=8192,heads=64,seq=1024,vocab=51200 --batch 1024 \\
               --devices 64 --device v100-16gb [--json]
    plait plan --model my_model.py:build --sample-shape 64,1,28,28 --devices 2 [--json]

Prints the chosen layout (per stage: layers, time, memory) and the best alternatives, or with
--json exactly one JSON object: pp, dp, tp, num_microbatches, schedule, zero, stages (each with
its dp x tp mesh), predicted_step_time_s, peak_memory_bytes, feasible and, when infeasible,
reason; a feasible one also has each rank's parameter_bytes, gradient_bytes, optimizer_bytes and
activation_bytes, and with --gpt tflops_per_device; mixed_widths and mixed_dp: the best layout of
stages of different tp widths (one pipeline, or dp copies of one) or dp widths (one pipeline)
(null where none is searched or found); with --model, chosen: the layout (the candidate's layout
keys, `plait.planner.resolve.LAYOUT_KEYS`) a job of DEVICES ranks on this host chooses (`plait.planner.choice`, the one choice `Config()` makes; this host's
link is measured first, as a job measures it), and plan: the complete `Plan` that job builds (as
`model.plan.to_json()`; `Config(plan=FILE)` replays it). `--layout tp=8,pp=2` prices that layout only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from plait.cost.analytic import integer, key_values
from plait.errors import ConfigError

__all__ = ["add_plan_command", "run_plan"]

DESCRIPTION = (
    "Choose pipeline stages (pp), data-parallel replicas (dp), micro-batches, schedule, "
    "recomputation and ZeRO sharding for a model on DEVICES devices, with the layers of each stage, by an exact "
    "partition of a cost model. --gpt describes a GPT and plans it analytically for --device; "
    "--model profiles your own model on this machine first."
)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def add_plan_command(commands: Any) -> None:
    """Register `plait plan` on the CLI's subparsers."""
    plan = commands.add_parser("plan", help="plan pp x dp, micro-batches and schedule for a model",
                               description=DESCRIPTION)
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument("--gpt", metavar="SPEC",
                       help="layers=L,hidden=H,heads=A[,seq=S][,vocab=V]: a GPT planned analytically")
    model.add_argument("--model", metavar="FILE.py:FN",
                       help="a function returning your nn.Module (file path or module name), profiled here")
    plan.add_argument("--devices", type=int, required=True, metavar="N", help="devices (ranks) in all")
    plan.add_argument("--batch", type=int, default=None, metavar="B",
                      help="global batch in rows (default: the --sample-shape rows; required with --gpt)")
    plan.add_argument("--device", default=None, metavar="NAME",
                      help="device preset: v100-16gb, a100-40gb, a100-80gb, h100-80gb, h200-141gb, mi250x, cpu, "
                           "or FILE.json describing one (a preset's Device.to_dict(), edited) "
                           "(default: v100-16gb with --gpt; with --model, this machine: its times "
                           "are always measured here, a preset only sets memory and network)")
    plan.add_argument("--memory-gb", type=float, default=None, metavar="GB",
                      help="memory per device for the model, GiB (default: 90%% of the preset's; "
                           "with --model and no --device, 90%% of this machine's RAM per device)")
    plan.add_argument("--sample-shape", type=_ints, default=None, metavar="B,...",
                      help="--model: shape of a random input batch, rows first (e.g. 64,1,28,28)")
    plan.add_argument("--sample-dtype", choices=("float32", "int64"), default="float32",
                      help="--model: dtype of the random input (int64: zeros, for token ids)")
    plan.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                      help="--model: the dtype its stages compute in, as Config(precision=...): profiled in it, "
                           "its memory held as fp32 masters beside the copies (--gpt prices its preset's dtype)")
    plan.add_argument("--optimizer", choices=("adam", "sgd-momentum", "sgd"), default="adam",
                      help="optimizer whose state counts in memory (default: adam)")
    plan.add_argument("--schedules", default=None, metavar="S,...",
                      help="schedules to consider (default: all four)")
    plan.add_argument("--pp", type=_ints, default=None, metavar="P,...", help="pipeline sizes to consider")
    plan.add_argument("--tp", type=_ints, default=None, metavar="T,...",
                      help="tensor-parallel sizes to consider (default: 1, 2, 4, 8 within a node)")
    plan.add_argument("--microbatches", type=_ints, default=None, metavar="M,...",
                      help="micro-batch counts to consider (default: powers of two, multiples of pp)")
    plan.add_argument("--no-recompute", dest="recompute", action="store_const", const=(False,),
                      default=(False, True), help="never recompute activations")
    plan.add_argument("--no-offload", dest="offload", action="store_false", help="never offload zero=3's shards and "
                      "optimizer to host memory (default: where nothing else fits, on a preset beside a host)")
    plan.add_argument("--zero", type=int, choices=(0, 1, 2), default=None,
                      help="ZeRO level: 0 replicated optimizer state, 1 sharded over the dp replicas, "
                           "2 gradients too (default: the planner chooses; 1 and 2 only where dp > 1)")
    plan.add_argument("--layout", default=None, metavar="tp=T,pp=P[,dp=D,zero=Z,m=M,schedule=S,recompute=0|1,overlap=0|1]",
                      help="price this layout only (dp defaults to devices / (tp x pp)); what it leaves "
                           "out (micro-batches, schedule, recomputation, ZeRO) the planner still chooses; overlap=0 "
                           "sums the gradients after the pipeline (as Megatron-LM's local DDP)")
    plan.add_argument("--top", type=int, default=5, metavar="K", help="candidates shown (default: 5)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    plan.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="also save the JSON here")


def _load_model(spec: str) -> Any:
    """`path/to/file.py:fn` or `package.module:fn` -> fn()."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"--model {spec!r}: write FILE.py:FUNCTION or module.name:FUNCTION")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"--model: no file {where!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ConfigError(f"--model: {where} has no {name!r}")
    return getattr(module, name)()


LAYOUT_KEYS = ("tp", "pp", "dp", "zero", "m", "schedule", "recompute", "overlap")


def apply_layout(args: argparse.Namespace) -> None:
    """`--layout tp=8,pp=2,...` -> the single values of --tp, --pp, --zero, --microbatches,
    --schedules and the recomputation searched (recompute=0: never, 1: always); overlap=0 sums the
    gradients after the pipeline instead of during its last gradient pass."""
    args.overlap = True
    if args.layout is None:
        return
    given = key_values(args.layout, "--layout", LAYOUT_KEYS,
                       f"KEY=VALUE with KEY one of {', '.join(LAYOUT_KEYS)}, e.g. --layout tp=8,pp=2")
    numbers: dict[str, int] = {}
    for key in ("tp", "pp", "dp", "zero", "m", "recompute", "overlap"):
        if key in given:
            numbers[key] = integer("--layout", key, given[key])
            flag = key in ("recompute", "overlap")
            if numbers[key] < (0 if key == "zero" or flag else 1) or (flag and numbers[key] > 1):
                raise ConfigError(f"--layout {key}={numbers[key]} is out of range; tp, pp, dp and m are >= 1, "
                                  "recompute and overlap are 0 or 1")
    tp, pp = numbers.get("tp", 1), numbers.get("pp")
    if args.devices % tp or (pp is not None and args.devices % (tp * pp)):
        raise ConfigError(f"--layout tp={tp}{f',pp={pp}' if pp else ''} does not divide --devices {args.devices}; "
                          "tp x pp x dp must be the device count")
    if "dp" in numbers:
        if pp is None:
            if args.devices % (tp * numbers["dp"]):
                raise ConfigError(f"--layout tp={tp},dp={numbers['dp']} does not divide --devices {args.devices}")
            pp = args.devices // (tp * numbers["dp"])
        elif tp * pp * numbers["dp"] != args.devices:
            raise ConfigError(f"--layout tp={tp} x pp={pp} x dp={numbers['dp']} = {tp * pp * numbers['dp']}, "
                              f"not --devices {args.devices}; drop dp or make the product the device count")
    args.tp = (tp,)
    if pp is not None:
        args.pp = (pp,)
    if "zero" in numbers:
        args.zero = numbers["zero"]
    if "m" in numbers:
        args.microbatches = (numbers["m"],)
    if "schedule" in given:
        args.schedules = given["schedule"]
    if "recompute" in numbers:
        args.recompute = (numbers["recompute"] == 1,)
    args.overlap = numbers.get("overlap", 1) == 1


def _search_space(args: argparse.Namespace, base: Any = None) -> Any:
    """`base` (`Config()`'s space, `plait.planner.choice.search_space`; default: every setting) with
    what the options give in its place."""
    from plait.search.search import SearchSpace

    space = base if base is not None else SearchSpace()
    given: dict[str, Any] = {"keep": max(1, args.top), "recompute": args.recompute}
    if args.schedules is not None:
        given["schedules"] = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    if args.pp is not None:
        given["pp"] = args.pp
    if args.microbatches is not None:
        given["num_microbatches"] = args.microbatches
    if args.zero is not None:
        given["zero"] = (args.zero,)
    return dataclasses.replace(space, **given)


def _with_offload(space: Any, cluster: Any, offload: bool) -> Any:
    """`space` with Config.offload's choices (`plait.planner.choice.offload_choices`); --no-offload: never."""
    from plait.planner.choice import offload_choices
    return dataclasses.replace(space, offload=offload_choices(None if offload else False, cluster.host_link))


def _config(args: argparse.Namespace) -> Any:
    """The `Config()` a job would plan with, given what the options fix (one schedule, ZeRO,
    recomputation on or off): the command and `Config()` choose by one function
    (`plait.planner.choice`)."""
    from plait.config import Config

    schedules = [s.strip() for s in (args.schedules or "").split(",") if s.strip()]
    return Config(schedule=schedules[0] if len(schedules) == 1 else None, zero=args.zero, precision=args.precision,
                  recompute=args.recompute[0] if len(args.recompute) == 1 else None, offload=None if args.offload else False)


def _plan(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from plait.cost.analytic import gpt_costs, gpt_tp_shares, megatron_flops, parse_gpt
    from plait.cost.memory import optimizer_state_factor
    from plait.cost.devices import device
    from plait.cost.prediction import Cluster
    from plait.search.search import format_table
    from plait.search.tp_degree import search_tp, tp_degrees

    gib = 2**30
    if args.devices < 1:
        raise ConfigError(f"--devices must be at least 1, got {args.devices}")
    apply_layout(args)
    start = time.perf_counter()
    if args.gpt is not None:
        if args.batch is None:
            raise ConfigError("--gpt needs --batch (the global batch in sequences)")
        spec = parse_gpt(args.gpt)
        dev = device(args.device or "v100-16gb")
        if args.precision != "fp32":
            raise ConfigError(f"--precision {args.precision} is for --model; --gpt prices its device preset's "
                              f"dtype ({dev.dtype_bytes}-byte values on {dev.name})")
        memory = args.memory_gb * gib if args.memory_gb else dev.usable_memory()
        cluster = Cluster(dev.network, memory, optimizer_state_factor(args.optimizer, dev.dtype_bytes),
                          overlap_gradients=args.overlap, host_link=dev.host_link, host_bandwidth=dev.host_bandwidth)
        tps = tuple(args.tp) if args.tp else tp_degrees(args.devices, dev.network.devices_per_node)
        found = search_tp(gpt_costs(spec, dev, args.optimizer), {t: gpt_tp_shares(spec, dev, t) for t in tps if t > 1},
                          args.devices, args.batch, cluster, _with_offload(_search_space(args), cluster, args.offload), degrees=tps)
        widths = _gpt_widths(args, spec, dev, cluster)  # stages of different widths, as Config() searches them
        chosen = plan = None  # a described GPT: no Config() runs it here
        head = {"model": f"GPT {args.gpt} ({spec.parameters / 1e9:.2f}B parameters)",
                "device": dev.name, "devices": args.devices, "global_batch": args.batch,
                "precision": f"{'2-byte (bf16 or fp16)' if dev.dtype_bytes == 2 else 'fp32'} values, "
                             f"the {dev.name} preset's"}
        costs_source = f"analytic, {dev.name}"
    else:
        import torch

        from plait.capture.compute_dtype import as_computed, dtype_of, held_in
        from plait.cost.memory import optimizer_state_factor as state_factor
        from plait.planner.autoplan import PlanOptions, plan_model
        from plait.planner.calibrate import measure_here
        from plait.planner.choice import choose, search_inputs

        if args.sample_shape is None:
            raise ConfigError("--model needs --sample-shape ROWS,... (a batch the model takes)")
        net = _load_model(args.model)
        shape = args.sample_shape
        sample = (torch.zeros(shape, dtype=torch.int64) if args.sample_dtype == "int64"
                  else torch.randn(shape))
        batch = args.batch or shape[0]
        # What a job of --devices ranks on this host would plan with (`Config()`'s inputs): this
        # host's link measured on its backend, its memory and cores shared by the ranks.
        config, factor = _config(args), state_factor(args.optimizer, 4)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        network = None if args.device is not None or backend == "nccl" else measure_here(args.devices)
        inputs = search_inputs(config, args.devices, batch, args.devices, factor, network, backend)
        cluster = inputs.cluster
        if args.device is not None:  # a preset's memory and network in place of this host's
            dev = device(args.device)
            memory = args.memory_gb * gib if args.memory_gb else dev.usable_memory()
            cluster = dataclasses.replace(cluster, network=dev.network, memory_bytes=memory, host_link=dev.host_link,
                                          host_bandwidth=dev.host_bandwidth)
        elif args.memory_gb:
            cluster = dataclasses.replace(cluster, memory_bytes=args.memory_gb * gib)
        if not args.overlap:
            cluster = dataclasses.replace(cluster, overlap_gradients=False)
        tps = tuple(args.tp) if args.tp else inputs.tp
        dtype = dtype_of(args.precision)  # the model profiled as its stages will compute
        with held_in(net, dtype):
            sample = as_computed(sample, args.precision)
            captured = _captured(net, sample, args)
            result = plan_model(net, sample, args.devices, batch, cluster,
                                PlanOptions(space=_with_offload(_search_space(args, inputs.space), cluster, args.offload), tp=tps, captured=captured,
                                            precision=args.precision))
        found = result.candidates
        chosen = choose(result, config, args.devices, inputs.source, captured).fields \
            if result.best.feasible and args.layout is None else None
        plan = None if chosen is None else _complete_plan(net, sample, captured, config, chosen, args)
        widths = _model_widths(args, captured, result, cluster)
        head = {"model": args.model, "device": args.device or "this machine",
                "devices": args.devices, "global_batch": batch, "precision": args.precision}
        costs_source = result.profile.costs.source + (" (cached)" if result.profile.cached else "")
    elapsed = time.perf_counter() - start
    mixed, mixed_dp = widths.tp, widths.dp  # stages of different tp widths, of different dp widths
    data = found[0].to_dict()
    data.update(head)
    data["planning_time_s"] = elapsed
    data["costs"] = costs_source
    data["alternatives"] = [c.to_dict() for c in found[1:]]
    for entry in [data, *data["alternatives"]]:  # each stage runs on a dp x tp mesh of its own
        for stage in entry["stages"]:
            stage["mesh"] = {"dp": entry["dp"], "tp": entry["tp"]}
    if args.layout is not None:
        data["layout"] = args.layout
    data["mixed_widths"] = mixed.to_dict() if mixed is not None else None
    data["mixed_dp"] = mixed_dp.to_dict() if mixed_dp is not None else None
    data["chosen"] = chosen  # --model: the layout (the candidate's layout keys) a job of --devices ranks here runs
    data["plan"] = None if plan is None else json.loads(plan.to_json())  # ... and the complete Plan it builds
    rate = ""
    if args.gpt is not None and data.get("predicted_step_time_s"):  # Megatron's count over the predicted step
        data["tflops_per_device"] = megatron_flops(spec, args.batch) / (data["predicted_step_time_s"] * args.devices) / 1e12
        rate = f"; predicted {data['tflops_per_device']:.1f} TFLOP/s per device (Megatron's FLOP count)"
    text = (f"plait plan: {head['model']} on {args.devices} x {head['device']} "
            f"({cluster.memory_bytes / gib:.2f} GiB each), global batch {head['global_batch']}, "
            f"computing in {head['precision']}; "
            f"costs {costs_source}; planned in {elapsed:.2f} s{rate}\n" + format_table(found, args.top))
    if chosen is not None:
        text += f"\nConfig() on {args.devices} rank(s) here runs: {chosen}"
    if mixed is not None:
        copies = f"{mixed.dp} copies of a pipeline; Config(layers_per_stage, stage_tp, dp={mixed.dp})" \
            if mixed.dp > 1 else "one pipeline; Config(layers_per_stage, stage_tp)"
        text += (f"\nstages of different tp widths ({copies}): tp "
                 f"{list(mixed.widths)}, layers {list(mixed.layers_per_stage)}, {mixed.num_microbatches} "
                 f"micro-batches, {mixed.schedule}{', recomputed' if mixed.recompute else ''}, crossing as "
                 f"{mixed.crossing}: {mixed.step_time_s:.4f} s a step")
    if mixed_dp is not None:
        text += (f"\nstages of different dp widths (one pipeline; Config(layers_per_stage, stage_dp)): dp "
                 f"{list(mixed_dp.dp)}, layers {list(mixed_dp.layers_per_stage)}, {mixed_dp.num_microbatches} "
                 f"micro-batches, {mixed_dp.schedule}{', recomputed' if mixed_dp.recompute else ''}: "
                 f"{mixed_dp.step_time_s:.4f} s a step")
    return data, text


def _complete_plan(net: Any, sample: Any, captured: Any, config: Any, chosen: dict[str, Any],
                   args: argparse.Namespace) -> Any:
    """The complete `Plan` a job of --devices ranks here builds from `chosen`: resolved and completed
    (tied parameters, tp layouts) by the planner's one path (`plait.planner.layout.layout_of`)."""
    from plait.capture.compute_dtype import dtype_of, held_in
    from plait.planner.autoplan import capture_sample
    from plait.planner.layout import Workload, layout_of

    with held_in(net, dtype_of(args.precision)):
        graph = captured if captured is not None else capture_sample(net, sample)
        return layout_of(config, Workload(net, graph, sample), args.devices, chosen=chosen).plan


def _captured(net: Any, sample: Any, args: argparse.Namespace) -> Any:
    """The model captured once, for pricing tp and stages of different widths; None where neither
    is searched (one device, or --tp 1: no width splits)."""
    from plait.planner.autoplan import capture_sample

    if args.devices < 2 or args.tp == (1,):
        return None
    return capture_sample(net, sample)


def _stage_widths(args: argparse.Namespace, costs: Any, shares_at: Any, global_batch: int, cluster: Any) -> Any:
    """The best layouts of stages of different tp widths (one pipeline, or copies of one) and of
    different dp widths (one pipeline; where tp = 1 is among --tp): the search `Config()` runs,
    within the same limits (`plait.search.width_search.search_stage_widths`, `WIDTH_LIMITS`), each
    kind's best shown whatever its step; nothing with --layout. `shares_at(widths)`: each tp
    width's shares, read only within the limits."""
    from plait.search.width_search import (WIDTH_LIMITS, StageWidths, WidthChoices, search_stage_widths,
                                           stage_widths)

    if args.layout is not None:
        return StageWidths()
    widths = tuple(args.tp) if args.tp else stage_widths(args.devices, cluster.network.devices_per_node)
    shares = shares_at(widths) if WIDTH_LIMITS.allow(args.devices, costs.num_layers) else {}
    return search_stage_widths(costs, shares, args.devices, global_batch, cluster,
                               WidthChoices(widths, 1 in widths, _search_space(args)))


def _gpt_widths(args: argparse.Namespace, spec: Any, dev: Any, cluster: Any) -> Any:
    """`_stage_widths` of a described GPT: each width's shares analytic (`gpt_tp_shares`)."""
    from plait.cost.analytic import gpt_costs, gpt_tp_shares

    return _stage_widths(args, gpt_costs(spec, dev, args.optimizer),
                         lambda widths: {w: gpt_tp_shares(spec, dev, w) for w in widths if w > 1}, args.batch, cluster)


def _model_widths(args: argparse.Namespace, captured: Any, result: Any, cluster: Any) -> Any:
    """`_stage_widths` of a captured model: each width's shares read off its graph as `Config()`
    reads them (`plait.planner.widths.width_shares`; none where it was not captured), the layers'
    costs from the profile."""
    from plait.planner.widths import width_shares

    return _stage_widths(args, result.profile.costs,
                         lambda widths: {} if captured is None else width_shares(captured, widths, precision=args.precision),
                         result.global_batch, cluster)


def run_plan(args: argparse.Namespace) -> int:
    """Run `plait plan`; print the table or the JSON object (0 whether or not a layout fits:
    `feasible` and `reason` say)."""
    data, text = _plan(args)
    if args.output is not None:
        Path(args.output).write_text(json.dumps(data, indent=1))
    print(json.dumps(data) if args.json else text)
    return 0
