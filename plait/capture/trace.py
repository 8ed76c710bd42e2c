"""Capturing a model into a `CapturedGraph`: torch.export first, torch.fx as the fallback."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from plait import data as batching
from plait.capture.layers import LayerAssignment, assign_layers
from plait.capture.opaque import modules_to_keep
from plait.capture.output import OutputSpec, flatten_output
from plait.capture.stopped import Stop, stopped_in
from plait.capture.tracers import Traced, trace_export, trace_fx
from plait.errors import CaptureError, ModelError, PlaitError, model_frame
from plait.materialize import on_meta

__all__ = ["CapturedGraph", "capture", "fingerprint", "in_mode", "capture_batch", "sample_rows", "is_local",
           "retarget", "raised_eagerly"]

log = logging.getLogger("plait")


@dataclass
class CapturedGraph:
    """One traced forward pass of the model, with its operations grouped into layers.

    graph: the fx graph (placeholders = model inputs, get_attr = parameters/buffers/constants).
    root: module that get_attr / call_module targets resolve against; shares the user's parameters.
    ops: the graph's operations in execution order, aligned with `layers.op_layer`.
    bind: (args, kwargs) of one call -> the value of every placeholder, in graph order.
    finish: the graph's output value -> exactly what `net(...)` returns.
    """

    method: str
    graph: fx.Graph
    root: nn.Module
    ops: list[fx.Node]
    layers: LayerAssignment
    bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]
    finish: Callable[[Any], Any]
    output_spec: OutputSpec | None = None  # the structure of net's output (`capture_batch` sets it)
    kept_whole: tuple[str, ...] = ()  # modules captured as one opaque call each (capture/opaque.py)


def is_local(node: fx.Node) -> bool:
    """Nodes every stage can make for itself instead of receiving: inputs, attributes, input sizes."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op == "call_function" and node.target is torch.ops.aten.sym_size.int:
        return isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
    if node.op == "call_method" and node.target == "size":
        return isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
    return False


def fingerprint(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a capture depends on besides the code: mode, module tree, flags, tensors, input kinds."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    inputs = tuple(
        (x.dtype, tuple(x.shape[1:]), x.dim()) if isinstance(x, torch.Tensor) else repr(x) for x in leaves
    )
    modules = tuple(
        (name, type(m), m.training, tuple(sorted(
            (k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str, type(None)))
        )))
        for name, m in net.named_modules(remove_duplicate=False)
    )
    tensors = tuple(
        (name, id(t), tuple(t.shape), t.dtype)
        for name, t in list(net.named_parameters(remove_duplicate=False))
        + list(net.named_buffers(remove_duplicate=False))
    )
    return (str(spec), inputs, modules, tensors)


RETRIES = 3  # modules (classes) kept whole, one more per torch.export failure, before torch.fx


def capture(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            keep: Sequence[str | type] = ()) -> CapturedGraph:
    """Trace `net` on one sample call, in its current train/eval mode.

    torch.export(strict=False) handles most real models (transformers with RoPE, masks, output
    dataclasses). Where it stops inside a submodule (data-dependent control flow, MoE routing),
    that module's class is kept whole (capture/opaque.py) and export tried again, up to RETRIES
    times; `keep` (module names or classes, `Config(leaf_modules=...)`) are kept whole from the
    start. torch.fx.symbolic_trace, with the same modules as leaves, is the fallback. Both
    failing raises CaptureError naming the module and line where each stopped and the fix.
    """
    kept = modules_to_keep(net, keep)
    stop: Stop | None = None  # where the last torch.export attempt stopped
    export_error: BaseException | None = None
    for _ in range(RETRIES + 1):
        try:
            return _finish_capture(net, trace_export(net, args, kwargs, kept))
        except Exception as error:  # noqa: BLE001 - every tracer failure leads on
            export_error = error
            stop = stopped_in(export_error, net)
            log.info("plait: torch.export failed (%s)%s", _first_line(export_error),
                     f" in {stop.describe()}" if stop else "")
            if stop is None or not stop.module or isinstance(export_error, CaptureError):
                break
            more = modules_to_keep(net, [type(net.get_submodule(stop.module))])
            if set(more) <= set(kept):
                break
            kept = modules_to_keep(net, [*kept, *more])
    try:
        return _finish_capture(net, trace_fx(net, kept))
    except Exception as fx_error:  # noqa: BLE001
        assert export_error is not None
        raise CaptureError(_failure(net, export_error, stop, fx_error, kept)) from fx_error


def _failure(net: nn.Module, export_error: BaseException, stop: Stop | None, fx_error: BaseException,
             kept: list[str]) -> str:
    """What each tracer stopped at, where, and what to do about it."""
    fx_stop = stopped_in(fx_error, net)
    culprit = stop or fx_stop
    fix = ("make that construct traceable (for example avoid data-dependent Python control flow on "
           "tensor values)")
    if culprit is not None and culprit.module:
        fix += f", or keep the module whole: Config(leaf_modules=[{culprit.module!r}])"
    else:
        fix += ", or move it into a submodule and keep that whole: Config(leaf_modules=['its.name'])"
    return (
        f"could not capture {type(net).__name__}: torch.export(strict=False) stopped"
        f"{f' in {stop.describe()}' if stop else ''}: {_first_line(export_error)}; "
        f"torch.fx.symbolic_trace stopped{f' in {fx_stop.describe()}' if fx_stop else ''}: "
        f"{_first_line(fx_error)}"
        f"{f' (modules kept whole: {kept})' if kept else ''}. To fix it, {fix}"
    )


def sample_rows(x: Any) -> Any:
    """Two rows of a batch (one duplicated if there is only one): a size-1 batch would fix dim 0."""
    if batching.num_rows(x) >= 2:
        return batching.slice_rows(x, 0, 2)
    return batching.take(x, torch.tensor([0, 0]))


def capture_batch(net: nn.Module, x: Any, train: bool = True, method: str | None = None,
                  keep: Sequence[str | type] = ()) -> CapturedGraph:
    """Capture `net` on two rows of `x` (a batch as `fit` takes it) in train or eval mode, with
    the structure of its output; `net` keeps its mode.

    Both tracers bake the mode in: torch.export records the ops of that mode, and torch.fx reads
    `self.training` once while tracing (`F.dropout(x, p, self.training)`, `if self.training:`).
    So a model is captured once in train mode (`Model` passes the graph to the planner and the
    pipeline) and, for evaluation, once in eval mode with the training graph's `method`:
    "torch.fx" goes straight to the fallback that export already failed once (then both graphs
    name their layers the same way); None or "torch.export" tries torch.export first. `keep`:
    the modules to keep whole (`Config(leaf_modules=...)`, or the training graph's `kept_whole`).
    """
    args, kwargs = batching.as_call(sample_rows(x))
    meta = on_meta(net)
    if meta:  # a model built on the meta device is captured on meta: no memory, no values
        args, kwargs = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    try:
        with in_mode(net, train):
            captured = (_capture_fx_again(net, train, keep) if method == "torch.fx"
                        else capture(net, args, kwargs, keep))
        if meta and captured.output_spec is not None:  # eager code on meta may need values (.item())
            return captured
        with torch.no_grad(), torch.random.fork_rng(), in_mode(net, False):
            _, output_spec = flatten_output(net(*args, **kwargs))
        return replace(captured, output_spec=output_spec)
    except Exception as error:  # noqa: BLE001 - told apart below, outside this handler
        failed = error
    # A tracer's limit, or the model's own code raising (which it does without plait too)? Run
    # out of the handler, so the user's exception does not chain onto the tracers' advice. On
    # meta an eager run may stop for want of values (.item()): the tracers' error stands.
    raised = None if meta or isinstance(failed, PlaitError) and not isinstance(failed, CaptureError) \
        else raised_eagerly(net, args, kwargs, train)
    if raised is None:
        raise failed
    raise _model_raised(net, raised, train) from raised


def raised_eagerly(net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool) -> Exception | None:
    """What `net(*args, **kwargs)` raises run as it is, without a tracer, in train or eval mode (None:
    it runs). No gradients, the RNG and every buffer (batch norm's running statistics) left as they were."""
    buffers = [(b, b.detach().clone()) for b in net.buffers() if not b.is_meta]
    try:
        with torch.no_grad(), torch.random.fork_rng(), in_mode(net, train):
            net(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the model's own failure, whatever it is
        return None if isinstance(error, PlaitError) else error
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return None


def _model_raised(net: nn.Module, error: Exception, train: bool) -> ModelError:
    """The error of a model whose forward raises by itself: the user's exception and line, not a tracer's limit."""
    frame = model_frame(error)
    return ModelError(
        f"the model's code raised {_first_line(error)}\n  " + (f"at {frame}\n  " if frame else "")
        + f"while plait captured {type(net).__name__} (its forward, run once in {'train' if train else 'eval'} "
        "mode on 2 rows of the first batch, raises without plait too: not a tracing limit); fix the model's "
        "code or the batch it is given"
    )


def retarget(captured: CapturedGraph, device: torch.device) -> CapturedGraph:
    """A graph traced on the meta device, with the device constants its operations were given
    (`torch.arange(T, device=x.device)` traced as device="meta") set to `device`."""
    meta = torch.device("meta")

    def swap(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value == meta else value

    for node in captured.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if node.op == "get_attr":  # an empty constant the forward made (a key/value cache's start)
            owner_path, _, name = str(node.target).rpartition(".")
            owner = captured.root.get_submodule(owner_path) if owner_path else captured.root
            value = getattr(owner, name, None)
            if (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta
                    and value.numel() == 0 and name not in dict(owner.named_buffers(recurse=False))):
                setattr(owner, name, torch.empty(value.shape, dtype=value.dtype, device=device))
    return captured


@contextlib.contextmanager
def in_mode(net: nn.Module, train: bool) -> Iterator[None]:
    """`net` in train or eval mode inside, then every module's own flag as it was.

    A net already in that mode is left as it is, so a submodule the user put in eval mode inside
    a training model (a frozen dropout or batch norm) stays in eval mode, as in one process.
    """
    modes = [(m, m.training) for m in net.modules()]
    if net.training != train:
        net.train(train)
    try:
        yield
    finally:
        for module, training in modes:
            if module.training is not training:  # nn.Module's __setattr__ is slow: only where it changed
                module.training = training


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300]


def _capture_fx_again(net: nn.Module, train: bool, keep: Sequence[str | type]) -> CapturedGraph:
    """torch.fx in the other mode, for a model torch.fx captured before; a failure names the mode."""
    try:
        return _finish_capture(net, trace_fx(net, modules_to_keep(net, keep)))
    except Exception as fx_error:  # noqa: BLE001
        mode = "train" if train else "eval"
        raise CaptureError(
            f"could not capture {type(net).__name__} in {mode} mode: torch.fx.symbolic_trace stopped at: "
            f"{_first_line(fx_error)}. Make the code that runs in {mode} mode traceable too (for example "
            "avoid data-dependent Python control flow on tensor values), or wrap it in a leaf module"
        ) from fx_error


def _finish_capture(net: nn.Module, traced: Traced) -> CapturedGraph:
    """The `CapturedGraph` of a tracer's graph of `net`: its operations grouped into layers."""
    graph, leaf_of = traced.graph, traced.leaf_of
    ops = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if not ops:
        raise CaptureError(f"{type(net).__name__}.forward performs no operation; nothing to split")
    found = [leaf_of(n) for n in ops]
    leaves = [f[0] if f is not None else None for f in found]
    calls = [f[1] if f is not None else None for f in found]
    buffered = {  # leaves whose calls may update state of their own: a reused one stays whole
        name or "<net>" for name, module in net.named_modules()
        if any(True for _ in module.buffers(recurse=False)) and not any(True for _ in module.children())
    }
    layers = assign_layers(leaves, buffered, calls)
    log.info("plait: captured %d layers with %s", len(layers.layer_names), traced.method)
    return CapturedGraph(traced.method, graph, traced.root, ops, layers, traced.bind, traced.finish,
                         output_spec=traced.output_spec, kept_whole=traced.kept_whole)
