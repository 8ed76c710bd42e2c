"""Materializing a model built on the meta device: tensors allocated, each module initialised by (seed, name).

A model built under `torch.device("meta")` holds shapes and no memory. plait captures it as it
is, and each rank allocates only the tensors its stages use: every rank that holds a tensor
computes the same values, whatever the layout, because each module is initialised by its own
code under an RNG seeded from `Config.seed` and the module's qualified name::

    for each module, children before parents (as Hugging Face's initialize_weights goes),
    on the CPU (its generator's draws are the same everywhere; a GPU rank's move there after):
        torch.manual_seed(hash(seed, "model.layers.3.mlp.up_proj"))
        init_fn(module)  or  net._init_weights(module) (a Hugging Face PreTrainedModel)
                         or  module.reset_parameters()

A rank calls this for the modules that hold (directly or below) a tensor it uses, with the
other tensors still on meta (an initialiser's draws for a meta tensor consume no random
numbers, so an initialiser should draw each tensor's values from its own call: torch's and
Hugging Face's do). `plait.materialize(net, seed)` does the same for every tensor in one
process, which is what a distributed run is compared with.

Each meta tensor is replaced by a real one (a new Parameter where it was one) in every module
tree given -- the net, and the captured graphs, which hold the same objects -- so ties stay
ties; `plait.Model` does this before it builds the pipeline, so every later holder (stage
modules, optimizer, gradient hooks) sees the real tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
from itertools import chain
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from plait.errors import ConfigError
from plait.tensor_parts import as_held, whole_shape

__all__ = ["materialize", "materialize_tensors", "defer_parameters", "Deferred", "on_meta", "module_seed",
           "release_parameters"]

InitFn = Callable[[nn.Module], None]


def on_meta(net: nn.Module) -> bool:
    """Whether any parameter or buffer of `net` is on the meta device."""
    return any(t.is_meta for t in chain(net.parameters(), net.buffers()))


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of one module: a hash of (seed, qualified name), the same in every process."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize(net: nn.Module, seed: int = 0, init_fn: InitFn | None = None,
                device: torch.device | str = "cpu") -> nn.Module:
    """Allocate and initialise every meta tensor of `net` in place (one process); returns `net`.

    The values equal those each rank of a `plait.Model(net, Config(seed=seed, init_fn=...))`
    gives the tensors it holds, whatever the layout.
    """
    materialize_tensors(net, None, seed, init_fn, torch.device(device))
    return net


def materialize_tensors(net: nn.Module, wanted: Iterable[torch.Tensor] | None, seed: int,
                        init_fn: InitFn | None, device: torch.device, also: Sequence[nn.Module] = ()) -> int:
    """Allocate the meta tensors among `wanted` (None: all), in `net` and in the module trees
    `also` that share them, and initialise every module of `net` holding one of them; return how
    many tensors were allocated. Other meta tensors stay on meta."""
    wanted_ids = None if wanted is None else {id(t) for t in wanted}
    meta = [t for t in _unique(chain(net.parameters(), net.buffers()))
            if t.is_meta and (wanted_ids is None or id(t) in wanted_ids)]
    if not meta:
        return 0
    init = _initialiser(net, init_fn)
    touched = {id(t) for t in meta}
    modules = [(name, m) for name, m in _children_first(net)
               if touched & {id(t) for t in chain(m.parameters(), m.buffers())}]
    _check_initialisable(modules, init)  # before anything is allocated: an error leaves net on meta
    # Initialised on the CPU, whose generator draws the same values on every machine, then moved.
    cpu = {id(t): _real(t, torch.device("cpu")) for t in meta}
    for root in (net, *also):
        _replace(root, cpu)
    with torch.no_grad():
        _initialise(modules, seed, init)
        if device.type != "cpu":
            moved = {id(t): _real(t, device, t) for t in cpu.values()}
            for root in (net, *also):
                _replace(root, moved)
    return len(meta)


def _check_initialisable(modules: Sequence[tuple[str, nn.Module]], init: InitFn | None) -> None:
    """ConfigError naming a module holding tensors of its own that nothing can initialise."""
    for name, module in modules:
        own = list(chain(module.parameters(recurse=False), module.buffers(recurse=False)))
        if own and init is None and not hasattr(module, "reset_parameters"):
            raise ConfigError(
                f"module {name or '<net>'} ({type(module).__name__}) was built on the meta device and "
                "has no reset_parameters(), and no init_fn was given: give Config(init_fn=fn) that "
                "initialises a module in place, or load its weights (model.load) after building"
            )


def _initialise(modules: Sequence[tuple[str, nn.Module]], seed: int, init: InitFn | None) -> None:
    """Each module by its own code, under an RNG seeded by (seed, its name); the CPU's RNG."""
    for name, module in modules:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, name))
            if init is not None:
                init(module)
            elif any(True for _ in chain(module.parameters(recurse=False), module.buffers(recurse=False))):
                module.reset_parameters()  # type: ignore[operator]


def defer_parameters(net: nn.Module, params: Iterable[torch.Tensor], seed: int, init_fn: InitFn | None,
                     device: torch.device, also: Sequence[nn.Module] = ()) -> "Deferred":
    """Make the meta parameters among `params` real parameters on `device` that hold no memory yet,
    in `net` and in the module trees `also` that share them (so every later holder keeps these
    objects); `Deferred.fill` gives them their values when they are needed: a rank that shards its
    stage's parameters (ZeRO-3) fills a layer's just before it cuts them, and frees them after."""
    empty: dict[int, torch.Tensor] = {}
    for t in _unique(params):
        if t.is_meta and isinstance(t, nn.Parameter):
            real = nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device=device), t.requires_grad)
            real.untyped_storage().resize_(0)
            empty[id(t)] = real
    for root in (net, *also):
        _replace(root, empty)
    return Deferred(net, seed, _initialiser(net, init_fn), list(empty.values()))


class Deferred:
    """Parameters of a meta model made real without values (`defer_parameters`), each given its
    values by `fill`: the ones `materialize` gives it, whatever else of the model is real then."""

    def __init__(self, net: nn.Module, seed: int, init: InitFn | None, params: Sequence[torch.Tensor]):
        self.net, self.seed, self.init = net, seed, init
        self.pending: dict[int, torch.Tensor] = {id(p): p for p in params}

    def fill(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Allocate the pending ones among `params` and initialise them; returns them.

        Each module holding one (children before parents, as `materialize`) runs its initialiser
        under its own seed, on CPU copies of these parameters, with every other parameter and
        buffer of the net seen as meta (so it draws nothing for them and writes nothing else);
        the values are then copied into the parameters on their device (a parameter tensor parallelism
        cut since, `plait.runtime.tp`: its part of them)."""
        todo = list({id(p): p for p in params if id(p) in self.pending}.values())
        if not todo:
            return []
        staged: dict[int, torch.Tensor] = {id(p): nn.Parameter(torch.empty(whole_shape(p), dtype=p.dtype), p.requires_grad)
                                           for p in todo}  # (whole: a tp part is cut from its whole values)
        modules = [(name, m) for name, m in _children_first(self.net) if staged.keys() & {id(t) for t in m.parameters()}]
        _check_initialisable(modules, self.init)
        with torch.no_grad(), _seen_as(self.net, staged):
            _initialise(modules, self.seed, self.init)
        with torch.no_grad():
            for p in todo:
                p.untyped_storage().resize_(p.numel() * p.element_size())
                p.copy_(as_held(p, staged[id(p)]))
                del self.pending[id(p)]
        return todo


@contextlib.contextmanager
def _seen_as(net: nn.Module, staged: dict[int, torch.Tensor]) -> Iterator[None]:
    """Every parameter slot of `net` holding one of `staged`'s keys holds its staged tensor, every
    other parameter and buffer a meta tensor of its shape; all put back after."""
    placeholders: dict[int, torch.Tensor] = {}

    def seen(t: torch.Tensor) -> torch.Tensor:
        if id(t) in staged:
            return staged[id(t)]
        if id(t) not in placeholders:
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            placeholders[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
        return placeholders[id(t)]

    saved = [(table, key, value) for m in net.modules() for table in (m._parameters, m._buffers)
             for key, value in table.items() if value is not None]
    try:
        for table, key, value in saved:
            table[key] = seen(value)  # type: ignore[assignment]
        yield
    finally:
        for table, key, value in saved:
            table[key] = value  # type: ignore[assignment]


def _real(t: torch.Tensor, device: torch.device, values: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor like `t` on `device` (a Parameter where `t` is one): empty, or holding `values`."""
    real = torch.empty(t.shape, dtype=t.dtype, device=device) if values is None else values.detach().to(device)
    return nn.Parameter(real, t.requires_grad) if isinstance(t, nn.Parameter) else real


def release_parameters(net: nn.Module, keep: Iterable[torch.Tensor], also: Sequence[nn.Module] = ()) -> int:
    """Move every real parameter of `net` not among `keep` to the meta device, in `net` and in the
    module trees `also` that share them (the inverse of `materialize_tensors`): a rank of a real
    model frees what its stages do not use once they are built. Buffers stay (they are small, and
    a non-persistent one could not be brought back from a checkpoint). Returns how many were freed.

    A freed parameter comes back where `net.load_state_dict(state)` (or a submodule's) holds a
    value for it: allocated where it lived, then filled by torch's load as usual, so the plain
    pattern `net.load_state_dict(model.state_dict())` gives a whole module on every rank."""
    kept = {id(t) for t in keep}
    originals = [p for p in _unique(net.parameters()) if not p.is_meta and id(p) not in kept]
    replacement: dict[int, torch.Tensor] = {
        id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad) for p in originals
    }
    for root in (net, *also):
        _replace(root, replacement)
    freed = _FreedParameters.of(net)
    freed.devices.update({id(replacement[id(p)]): p.device for p in originals})
    freed.keep.extend(replacement[id(p)] for p in originals)  # ids stay theirs while they are known
    for module in net.modules():
        if any(id(v) in freed.devices for v in module._parameters.values() if v is not None):
            freed.watch(module)
    return len(replacement)


class _FreedParameters:
    """The parameters a rank freed in one net, and the load hook that brings them back (see
    `release_parameters`): on every module that holds one, before torch copies a state dict in."""

    ATTRIBUTE = "_plait_freed_parameters"

    def __init__(self, net: nn.Module) -> None:
        self.net = net
        self.devices: dict[int, torch.device] = {}  # id(meta parameter) -> where it lived
        self.keep: list[torch.Tensor] = []
        self.watched: set[int] = set()

    @classmethod
    def of(cls, net: nn.Module) -> "_FreedParameters":
        found = getattr(net, cls.ATTRIBUTE, None)
        if found is None:
            found = cls(net)
            object.__setattr__(net, cls.ATTRIBUTE, found)  # a plain attribute, not a submodule
        return found

    def watch(self, module: nn.Module) -> None:
        if id(module) not in self.watched:
            self.watched.add(id(module))
            module.register_load_state_dict_pre_hook(self._before_load)  # type: ignore[no-untyped-call]

    def _before_load(self, module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_: object) -> None:
        back = {id(p): _real(p, self.devices[id(p)]) for name, p in module._parameters.items()
                if p is not None and p.is_meta and id(p) in self.devices and prefix + name in state_dict}
        if back:  # everywhere in the net, so a tied parameter stays one tensor
            _replace(self.net, back)


def _replace(root: nn.Module, replacement: dict[int, torch.Tensor]) -> None:
    """Every parameter, buffer and tensor attribute of `root`'s modules found in `replacement`."""
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for key, value in table.items():
                if value is not None and id(value) in replacement:
                    table[key] = replacement[id(value)]  # type: ignore[assignment]
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and id(value) in replacement:
                setattr(module, key, replacement[id(value)])


def _initialiser(net: nn.Module, init_fn: InitFn | None) -> InitFn | None:
    """The user's init_fn, else a Hugging Face model's own `_init_weights`, else None (reset_parameters)."""
    if init_fn is not None:
        return init_fn
    hf_init = getattr(net, "_init_weights", None)
    if callable(hf_init) and hasattr(net, "config"):
        return hf_init  # type: ignore[no-any-return]
    return None


def _children_first(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module with its qualified name, children before their parent."""
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)
        out.append((prefix, module))

    visit("", net)
    return out


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())
