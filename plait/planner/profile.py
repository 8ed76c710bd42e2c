"""Measuring a model's per-layer costs on one process: times, bytes crossing each cut, memory.

The model is captured as `Model` captures it (train mode) and split into one stage module per
layer (`plait.capture.split`), and each layer runs as the runtime runs a stage: through
`StageExecutor`, on inputs made as the wire delivers them (`plait.runtime.comm.wire.as_received`), so
a layer is timed as exactly the code a stage would run, and what crosses a cut after layer i is
what `split` would send there. For each layer, at the sample's rows and at a quarter of them
(times are affine in rows, `LayerCosts`; the runs: `plait.planner.layer_runs`):

    forward   the stage's forward on its inputs (the last layer's with the loss)
    B         its input gradients, from random output gradients, as a zero-bubble stage runs
              them (`backward_input`; 0 where no received value carries a gradient)
    W         its weight gradients after B (`backward_weight`; 0 without trainable weights)
    whole     forward, then backward, through all layers for HELD copies of the sample kept
              alive at once, as a pipeline stage holds micro-batches; every layer's F is
              scaled by the whole forward over the layers' sum, B and W by the whole backward
              over theirs (a layer alone runs from cache)
    saved     bytes autograd saves for the backward (saved_tensors_hooks), parameters excluded
    optimizer one step of `optimizer` on copies of the layer's parameters, scaled by one step over
              copies of all layers' parameters (up to WHOLE_STEP_BYTES of them) over those layers'
              sum: like a layer's F and B, a layer's step alone runs from cache

Each of `repeats` rounds times every layer, then the whole pass; a layer's cost is the median
over rounds of its scaled times, so a host whose speed drifts moves a round's parts alike.
With `slowest` (planning: every rank profiles at once), each round's whole-pass times are the
slowest rank's: a synchronous step waits for its slowest rank, and on a shared host which
rank is slow changes from step to step, so one rank's own times price every step short
(benchmarks/planner.py part (c) measures both; docs/benchmarks.md has the figures).

The user's model is left as it was: parameters untouched, buffers restored, RNG state forked.
Results are cached in memory by a model signature (module tree, parameter shapes, input
shapes, threads, torch version) and, with `cache_dir`, on disk as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from plait import data as batching
from plait.capture.split import split
from plait.capture.trace import CapturedGraph, capture, fingerprint, in_mode
from plait.errors import ConfigError
from plait.plan.layer_costs import LayerCosts
from plait.planner.layer_runs import LayerRuns, tensor_bytes

__all__ = ["LayerProfile", "ProfileOptions", "profile"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Slowest = Callable[[list[float]], list[float]]  # every rank's values -> the element-wise maximum
_CACHE: dict[str, "LayerProfile"] = {}
WHOLE_STEP_BYTES = 2**30  # parameter bytes, at most, of the optimizer step timed over many layers at once


@dataclass(frozen=True)
class LayerProfile:
    """A model's measured `costs`, how they were measured, and whether they came from a cache."""

    costs: LayerCosts
    rows: int
    repeats: int
    threads: int
    seconds: float  # time the measurement took
    signature: str
    cached: bool = False


@dataclass(frozen=True)
class ProfileOptions:
    """How to measure a profile.

    loss, target: with both, the last layer's forward and backward include the loss; otherwise
        every layer's backward starts from random output gradients.
    repeats: rounds; each layer's time is the median over them.
    optimizer: the optimizer whose step is timed per layer's parameters.
    threads: the intra-op threads to measure with (None: the current setting), as each rank runs.
    cache_dir: where profiles are kept by signature (None: in memory only).
    reuse: False measures again even when a cached profile exists (and caches the new one).
    slowest: called by every rank profiling at once, with the same values in the same order
        (`plait.runtime.comm.collectives.max_floats`): each round's whole-model times become the
        slowest rank's, and a cached profile is used only when every rank has one (else all measure).
    captured: the model as captured in train mode (`Model` captures once); None: captured here.
    """

    loss: Callable[[Any, Any], torch.Tensor] | None = None
    target: Any = None
    repeats: int = 5
    optimizer: OptimizerFactory = torch.optim.Adam
    threads: int | None = None
    cache_dir: str | os.PathLike[str] | None = None
    reuse: bool = True
    slowest: Slowest | None = None
    captured: CapturedGraph | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or isinstance(self.repeats, bool) or self.repeats < 1:
            raise ConfigError(f"repeats must be an integer >= 1, got {self.repeats!r}")


def profile(net: nn.Module, sample_args: tuple[Any, ...], sample_kwargs: dict[str, Any] | None = None,
            options: ProfileOptions = ProfileOptions()) -> LayerProfile:
    """Measure every captured layer of `net` on the sample batch `net(*sample_args, **kwargs)`
    (see `ProfileOptions`); `net` is left as it was (mode, buffers, RNG)."""
    kwargs = dict(sample_kwargs or {})
    rows = batching.num_rows((sample_args, kwargs))
    old_threads = torch.get_num_threads()
    threads = options.threads or old_threads
    key = _signature(net, sample_args, kwargs, rows, options.repeats, threads, options.loss is not None,
                     options.optimizer, "slowest rank" if options.slowest is not None else "this process")
    path = Path(options.cache_dir) / f"profile-{key}.json" if options.cache_dir is not None else None
    found = _cached(key, path, rows, options.repeats, threads) if options.reuse else None
    if options.slowest is not None and options.slowest([0.0 if found else 1.0])[0] > 0:
        found = None  # a rank without it measures, and every other rank measures beside it
    if found is not None:
        return found
    start = time.perf_counter()
    torch.set_num_threads(threads)
    saved = {name: b.detach().clone() for name, b in net.named_buffers()}
    grads = {p: p.grad for p in net.parameters()}  # the stages accumulate theirs, as in training
    try:
        with torch.random.fork_rng(), in_mode(net, True):
            costs = _measure(net, sample_args, kwargs, rows, options)
    finally:
        with torch.no_grad():
            for name, b in net.named_buffers():
                b.copy_(saved[name])
        for p, grad in grads.items():
            p.grad = grad
        torch.set_num_threads(old_threads)
    result = LayerProfile(costs, rows, options.repeats, threads, time.perf_counter() - start, key)
    _CACHE[key] = result
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"costs": costs.to_dict(), "seconds": result.seconds}))
        tmp.replace(path)
    return result


def _cached(key: str, path: Path | None, rows: int, repeats: int, threads: int) -> LayerProfile | None:
    """The profile of signature `key` from memory, else from `path` (then kept in memory)."""
    if key in _CACHE:
        found = _CACHE[key]
        return LayerProfile(found.costs, found.rows, found.repeats, found.threads, found.seconds,
                            found.signature, cached=True)
    if path is None or not path.exists():
        return None
    stored = json.loads(path.read_text())
    found = LayerProfile(LayerCosts.from_dict(stored["costs"]), rows, repeats, threads,
                         float(stored["seconds"]), key, cached=True)
    _CACHE[key] = found
    return found


def _signature(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *extra: Any) -> str:
    """A stable hash of the capture fingerprint without object ids, and of how we measure."""
    spec, inputs, modules, tensors = fingerprint(net, args, kwargs)
    stable = (
        spec, inputs,
        tuple((name, f"{t.__module__}.{t.__qualname__}", training, flags)
              for name, t, training, flags in modules),
        tuple((name, shape, str(dtype)) for name, _, shape, dtype in tensors),
        torch.__version__, platform.machine(), platform.processor(), os.cpu_count(),
        tuple(getattr(e, "__qualname__", e) for e in extra),
    )
    return hashlib.sha256(repr(stable).encode()).hexdigest()[:20]


def _measure(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int,
             options: ProfileOptions) -> LayerCosts:
    """The layers' costs: every layer timed on `rows` and on a quarter of them, fitted affine in rows."""
    captured = options.captured if options.captured is not None else capture(net, args, kwargs)
    names = captured.layers.layer_names
    stages = split(captured, list(range(len(names))))
    small = max(1, rows // 4)
    big_run = LayerRuns(captured, stages, args, kwargs, rows, options)
    small_run = big_run if small == rows else LayerRuns(
        captured, stages, batching.slice_rows(args, 0, small), batching.slice_rows(kwargs, 0, small),
        small, options)
    repeats, slowest, optimizer = options.repeats, options.slowest, options.optimizer
    fixed: dict[str, list[float]] = {k: [] for k in ("f", "b", "w")}
    per_row: dict[str, list[float]] = {k: [] for k in ("f", "b", "w")}
    bigs, scale_big = big_run.measure()
    littles, scale_small = (bigs, scale_big) if small_run is big_run else small_run.measure()
    for big, little in zip(bigs, littles):
        for k in ("f", "b", "w"):
            a, c = _affine(big[k], little[k], rows, small)
            fixed[k].append(a)
            per_row[k].append(c)
    params = [list({id(p): p for p in st.module.parameters()}.values()) for st in stages]
    buffers = [list({id(b): b for b in st.module.buffers()}.values()) for st in stages]
    inputs = [x for x in captured.bind(args, kwargs)
              if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == rows]
    return LayerCosts(
        names=names,
        forward_fixed_s=tuple(fixed["f"]), forward_row_s=tuple(per_row["f"]),
        backward_fixed_s=tuple(fixed["b"]), backward_row_s=tuple(per_row["b"]),
        weight_fixed_s=tuple(fixed["w"]), weight_row_s=tuple(per_row["w"]),
        activation_row_bytes=tuple(s / rows for s in big_run.saved),
        output_row_bytes=tuple(o / rows for o in big_run.sent),
        param_bytes=tuple(float(tensor_bytes(p) + tensor_bytes(b)) for p, b in zip(params, buffers)),
        grad_bytes=tuple(float(tensor_bytes([p for p in ps if p.requires_grad])) for ps in params),
        optimizer_s=_optimizer_times(params, optimizer, repeats),
        input_row_bytes=tensor_bytes(inputs) / rows,
        uncuttable=captured.layers.uncuttable,
        source=f"profiled on {platform.node() or 'this machine'}: {rows} and {small} rows, "
               f"{torch.get_num_threads()} thread(s), median of {repeats}, layer times x "
               f"{scale_big[0]:.2f} / {scale_small[0]:.2f} (forward), x {scale_big[1]:.2f} / "
               f"{scale_small[1]:.2f} (backward) to the whole model's"
               + (" (the slowest rank's)" if slowest is not None else ""),
    )


def _affine(t_big: float, t_small: float, rows: int, small: int) -> tuple[float, float]:
    """(fixed, per_row) through the two measurements, both kept >= 0."""
    if rows == small:
        return 0.0, t_big / rows
    per_row = max(0.0, (t_big - t_small) / (rows - small))
    fixed = t_big - per_row * rows
    if fixed < 0:
        return 0.0, t_big / rows
    return fixed, per_row


def _optimizer_times(params: Sequence[list[nn.Parameter]], optimizer: OptimizerFactory,
                     repeats: int) -> tuple[float, ...]:
    """Each layer's optimizer step, timed alone and scaled by one step over the first layers
    together (as many as WHOLE_STEP_BYTES of parameters take, at least one) over their sum.

    A layer's parameters, gradients and state stepped again and again stay in cache; a stage's
    step goes through all of its layers' and streams them from memory (an MLP of 134 MB on one
    CPU thread: 13-15 ms in layer-sized steps, 20-23 ms in one, 20 ms after a real backward)."""
    alone = [_optimizer_time(ps, optimizer, repeats) for ps in params]
    together: dict[int, nn.Parameter] = {}
    count, nbytes = 0, 0
    for ps in params:
        more = {id(p): p for p in ps if p.requires_grad and id(p) not in together}
        nbytes += tensor_bytes(list(more.values()))
        if count and nbytes > WHOLE_STEP_BYTES:
            break
        together.update(more)
        count += 1
    summed = sum(alone[:count])
    if count < 2 or summed <= 0:
        return tuple(alone)
    scale = _optimizer_time(list(together.values()), optimizer, repeats) / summed
    return tuple(t * scale for t in alone)


def _optimizer_time(params: list[nn.Parameter], optimizer: OptimizerFactory, repeats: int) -> float:
    """Median seconds of one optimizer step over copies of `params` with random gradients."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return 0.0
    copies = [nn.Parameter(p.detach().clone()) for p in trainable]
    for c in copies:
        c.grad = torch.randn_like(c)
    opt = optimizer(copies)
    opt.step()  # the first step makes the state
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
