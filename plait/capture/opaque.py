"""Modules kept whole: one opaque call in the captured graph instead of the operations inside.

torch.export cannot trace code whose control flow depends on tensor values (`if idx.numel():`,
routing in a mixture of experts, padding checks). Such a module is kept whole, as the source
paper's layers are: while the model is exported, its forward is replaced by one call of the
custom operator `plait::kept`, which takes the call's tensors, parameters and buffers::

    graph:     ... linear -> plait.kept(key, [h, gate.weight, e0.weight, ...]) -> linear ...
    runtime:   the module's own forward, run eagerly on the real tensors (any Python it likes)
    backward:  the forward again under autograd (the RNG state restored, buffers left alone),
               then the gradients of its inputs and parameters (a recomputation, as
               torch.utils.checkpoint does)

The RNG state restored is the CPU generator's and, where the module runs on a GPU, that GPU's
generator's (dropout there draws from it): the call returns both states after its outputs.

Export needs each output's shape without running the module: the module is first run on the
sample batch and on the sample with one more row, and every output dimension is fitted as
a x (the first input's dim 0) + b; a dimension that fits no such rule cannot be kept whole.
The module is one layer; its parameters live on the stage that calls it.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.library import custom_op

from plait.errors import CaptureError

__all__ = ["kept_whole", "modules_to_keep"]


@dataclass(frozen=True)
class _Call:
    """One call of a kept module, as recorded on the sample: how to rebuild it and its outputs."""

    module: nn.Module
    name: str
    in_spec: Any  # pytree spec of (args, kwargs)
    consts: tuple[Any, ...]  # the non-tensor leaves of (args, kwargs); TENSOR where a tensor goes
    num_inputs: int  # tensor leaves of (args, kwargs); then parameters, then buffers
    out_spec: Any
    out_consts: tuple[Any, ...]  # the non-tensor leaves of the output; TENSOR where a tensor goes
    out_rules: tuple[tuple[torch.dtype, tuple[tuple[int, int], ...]], ...]  # per tensor: dtype, (a, b) per dim

    def arguments(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        it = iter(tensors[: self.num_inputs])
        leaves = [next(it) if c is TENSOR else c for c in self.consts]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return args, kwargs

    def state(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        names = [n for n, _ in self.module.named_parameters()] + [n for n, _ in self.module.named_buffers()]
        return dict(zip(names, tensors[self.num_inputs:]))


class _TensorSlot:
    """Where a tensor goes among a call's constant leaves (a real `None` argument is a leaf too)."""

    def __repr__(self) -> str:
        return "TENSOR"


TENSOR = _TensorSlot()
_CALLS: dict[int, _Call] = {}  # key -> call: the operator takes the key, an int
_KEYS = itertools.count()


def _cuda_device(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The GPU the module runs on (its first CUDA tensor's, inputs then parameters), or None on CPU."""
    return next((t.device for t in tensors if t.device.type == "cuda"), None)


def _device_rng(device: torch.device | None) -> torch.Tensor:
    """That GPU's generator state, to restore in the recomputation; empty on CPU."""
    return torch.empty(0, dtype=torch.uint8) if device is None else torch.cuda.get_rng_state(device)


@custom_op("plait::kept", mutates_args=())
def _kept(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The module's outputs, then the CPU and the GPU's RNG states it started from (for the
    backward's recomputation)."""
    call = _CALLS[key]
    rng = torch.get_rng_state()
    device_rng = _device_rng(_cuda_device(tensors))
    args, kwargs = call.arguments(tensors)
    out = call.module(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    rows = tensors[0].shape[0]
    for i, (t, (_, dims)) in enumerate(zip(leaves, call.out_rules)):
        want = [a * rows + b for a, b in dims]
        if list(t.shape) != want:
            raise CaptureError(
                f"{call.name} was kept whole and sized from the sample batch, but its output {i} has "
                f"shape {list(t.shape)} where {want} was expected for {rows} input rows: its output "
                "size depends on the data; keep a larger module whole (Config(leaf_modules=[...]))"
            )
    inputs = {t.untyped_storage().data_ptr() for t in tensors}
    # An operator's outputs may not alias its inputs (an identity module returns its input).
    outs = [t.clone() if t.untyped_storage().data_ptr() in inputs else t for t in leaves]
    return outs + [rng, device_rng]


@_kept.register_fake
def _kept_fake(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    call = _CALLS[key]
    rows = tensors[0].shape[0]
    outs = [torch.empty([a * rows + b for a, b in dims], dtype=dtype, device=tensors[0].device)
            for dtype, dims in call.out_rules]
    device = _cuda_device(tensors)
    device_bytes = 0 if device is None else torch.cuda.get_rng_state(device).numel()
    return outs + [torch.empty(_RNG_BYTES, dtype=torch.uint8), torch.empty(device_bytes, dtype=torch.uint8)]


_RNG_BYTES = torch.get_rng_state().numel()
_RNG_OUTPUTS = 2  # the CPU and the GPU's generator states, after the module's outputs


def _setup(ctx: Any, inputs: tuple[int, list[torch.Tensor]], output: list[torch.Tensor]) -> None:
    ctx.key = inputs[0]
    ctx.rng, ctx.device_rng = output[-_RNG_OUTPUTS:]
    ctx.mark_non_differentiable(*output[-_RNG_OUTPUTS:])
    ctx.save_for_backward(*inputs[1])


def _backward(ctx: Any, grads: list[torch.Tensor]) -> tuple[None, list[torch.Tensor | None]]:
    call = _CALLS[ctx.key]
    saved = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
    device = _cuda_device(saved)
    state = call.state(saved)
    for name, t in list(state.items()):
        if not t.requires_grad:  # buffers: a copy, so running statistics are not updated twice
            state[name] = t.clone()
    args, kwargs = call.arguments(saved)
    # both generators as the forward found them, and as they were again afterwards
    with torch.random.fork_rng(devices=[] if device is None else [device], device_type="cuda"), torch.enable_grad():
        torch.set_rng_state(ctx.rng)
        if device is not None:
            torch.cuda.set_rng_state(ctx.device_rng, device)
        out = torch.func.functional_call(call.module, state, args, kwargs)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    pairs = [(o, g) for o, g in zip(outs, grads[:-_RNG_OUTPUTS]) if o.requires_grad and g is not None]
    wanted = [t for t in saved if t.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                 if pairs and wanted else [None] * len(wanted))
    return None, [next(found) if t.requires_grad else None for t in saved]


_kept.register_autograd(_backward, setup_context=_setup)


def modules_to_keep(net: nn.Module, names_or_types: Sequence[str | type]) -> list[str]:
    """The qualified names of the modules of `net` that `names_or_types` selects: a module name
    selects that module, a class or class name every instance of it. Matching nothing is an error."""
    out: list[str] = []
    modules = dict(net.named_modules())
    for item in names_or_types:
        if isinstance(item, type):
            out += [n for n, m in modules.items() if isinstance(m, item) and n]
        elif item in modules and item:
            out.append(item)
        elif any(type(m).__name__ == item for n, m in modules.items() if n):
            out += [n for n, m in modules.items() if n and type(m).__name__ == item]
        else:
            candidates = [n for n in modules if n] + sorted({type(m).__name__ for m in modules.values()})
            close = difflib.get_close_matches(str(item), candidates, n=5)
            raise CaptureError(
                f"leaf_modules names {item!r}, which is not a submodule of {type(net).__name__}"
                f"{f' (similar: {close})' if close else ''}; give a name from net.named_modules() "
                ", a class name or a module class"
            )
    # a module inside another kept module is part of it
    return [n for n in dict.fromkeys(out) if not any(n.startswith(o + ".") for o in out if o != n)]


def _one_more_row(x: Any) -> Any:
    """The sample with its first row again at the end (every tensor with a batch dimension)."""
    return pytree.tree_map(
        lambda t: torch.cat([t, t[:1]]) if isinstance(t, torch.Tensor) and t.dim() > 0 else t, x)


def _fit(name: str, small: Any, large: Any, rows: tuple[int, int]) -> tuple[tuple[torch.dtype, tuple[tuple[int, int], ...]], ...]:
    """Each output tensor's dtype, and each dimension as a x rows + b, `rows` the first input's
    dim 0 in the two recorded calls."""
    rules = []
    for i, (s, t) in enumerate(zip(small, large)):
        dims = []
        for d, (n, m) in enumerate(zip(s.shape, t.shape)):
            a, rem = divmod(m - n, rows[1] - rows[0])
            if rem or s.dim() != t.dim():
                raise CaptureError(
                    f"{name} was kept whole, but its output {i} has dimension {d} of size {n} for "
                    f"{rows[0]} input rows and {m} for {rows[1]}, not a whole multiple of the rows: "
                    "plait cannot size it without running it; keep a larger module whole"
                )
            dims.append((a, n - a * rows[0]))
        rules.append((s.dtype, tuple(dims)))
    return tuple(rules)


def _record(net: nn.Module, names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, list[tuple[Any, Any]]]:
    """Every call of the named modules on (args, kwargs): ((call args, call kwargs), output)."""
    calls: dict[str, list[tuple[Any, Any]]] = {n: [] for n in names}
    buffers = [(b, b.clone()) for b in net.buffers()]  # running statistics: as they were, after
    handles = []
    for name in names:
        def hook(module: nn.Module, a: tuple[Any, ...], k: dict[str, Any], out: Any, name: str = name) -> None:
            calls[name].append(((a, k), out))
        handles.append(net.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            net(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return calls


@contextlib.contextmanager
def kept_whole(net: nn.Module, names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Inside, each named module's forward is one `plait::kept` call (for torch.export to trace);
    afterwards, the graph's calls run the modules' own forward."""
    if not names:
        yield
        return
    small = _record(net, names, args, kwargs)
    big_args, big_kwargs = _one_more_row((args, kwargs))
    large = _record(net, names, big_args, big_kwargs)
    patched = []
    for name in names:
        module = net.get_submodule(name)
        keys = []
        for ((a, k), out), (big_call, big_out) in zip(small[name], large[name]):
            leaves, in_spec = pytree.tree_flatten((a, k))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            big_first = next((t for t in pytree.tree_leaves(big_call) if isinstance(t, torch.Tensor)), None)
            if not tensors or tensors[0].dim() == 0 or big_first is None or big_first.shape[0] == tensors[0].shape[0]:
                raise CaptureError(f"{name} was kept whole, but its first tensor input has no batch dimension; "
                                   "keep a module whose first tensor input grows with the batch")
            out_leaves, out_spec = pytree.tree_flatten(out)
            big_leaves = [t for t in pytree.tree_leaves(big_out) if isinstance(t, torch.Tensor)]
            rows = (tensors[0].shape[0], big_first.shape[0])
            rules = _fit(name, [t for t in out_leaves if isinstance(t, torch.Tensor)], big_leaves, rows)
            key = next(_KEYS)
            _CALLS[key] = _Call(
                module, name, in_spec, tuple(TENSOR if isinstance(x, torch.Tensor) else x for x in leaves),
                len(tensors), out_spec, tuple(TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves), rules)
            keys.append(key)
        module.forward = _stand_in(module, keys)
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def _stand_in(module: nn.Module, keys: list[int]) -> Any:
    """The forward export traces: call i of the module is `plait::kept(keys[i], ...)` (modulo
    the number of calls, should the model be traced more than once)."""
    count = itertools.count()

    def forward(*args: Any, **kwargs: Any) -> Any:
        key = keys[next(count) % len(keys)]
        call = _CALLS[key]
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        # Read at call time: export swaps its own tensors in for the parameters and buffers.
        state = [p for _, p in module.named_parameters()] + [b for _, b in module.named_buffers()]
        outs = iter(_kept(key, [*tensors, *state]))
        out_leaves = [next(outs) if c is TENSOR else c for c in call.out_consts]
        return pytree.tree_unflatten(out_leaves, call.out_spec)

    return forward
