"""`ActivationMeter`: the bytes a rank holds for its backward passes, measured as the step runs.

A stage's forward, in training, keeps tensors for its backward: those autograd saves (counted by
a saved-tensor hook, parameters excluded, each tensor once by address and shape -- the planner's
profile counts a layer's the same way, `SavedBytes`) and the received inputs whose gradients go
upstream. They are held from the micro-batch's forward to its backward (with a split backward, to
its weight pass); the meter adds them at the forward, drops them there, and keeps the step's peak::

    F0 +a  F1 +a  B0 -a  F2 +a  B1 -a  B2 -a        live: a, 2a, a, 2a, a, 0    peak: 2a

A stage whose graph saves the same tensors for the same input shapes (every operation a torch
one: no module kept whole, whose Python may branch on the data) is counted once per input shapes
and holds that count at later forwards (`SavedShapes`): the hooks cost a few microseconds per
saved tensor, forward and backward, which a step of small micro-batches feels. A stage with a
module kept whole is counted at every forward.

The meter stands aside where the caller's own saved-tensor hooks are in use (e.g. torch's
`save_on_cpu`): a hook of its own inside would hide theirs. That step is then not measured.
A recomputed stage's forward saves nothing but its inputs; the one micro-batch it recomputes inside
its backward is transient and not counted (the planner's prediction of recomputed stages holds it).
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable

import torch
import torch.utils._pytree as pytree
from torch import fx

__all__ = ["ActivationMeter", "SavedBytes", "SavedShapes", "hooks_in_use"]


def hooks_in_use() -> bool:
    """Whether saved-tensor hooks are active around this call (the caller's, e.g. `save_on_cpu`)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class SavedBytes:
    """Within `with`: the bytes autograd saves for the backward, tensors of `exclude` (parameters)
    left out, each tensor counted once by (address, shape)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.data_ptr() for t in exclude}
        self._counted: dict[tuple[int, tuple[int, ...]], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add([t])
        # Detached: a pack hook returning an output itself makes a cycle output -> grad_fn ->
        # saved output that no collector frees, keeping a forward that never runs backward (the
        # planner's profile) alive with its parameters' gradient accumulators.
        return t.detach()

    def add(self, tensors: Iterable[Any]) -> None:
        """Count `tensors` too (those of them that are tensors)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in self._exclude:
                self._counted[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()

    @property
    def total(self) -> int:
        return sum(self._counted.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class ActivationMeter:
    """The bytes this rank's stages hold for backward passes now, and their peak in the step."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.blind = False  # a forward of this step ran under the caller's hooks: not measured
        self._held: dict[Any, int] = {}

    def start_step(self) -> None:
        """A new step: nothing held (the last step's backwards ran), the peak starts over."""
        self._held.clear()
        self.live = self.peak = 0
        self.blind = False

    def hold(self, key: Any, nbytes: int) -> None:
        """A forward (`key`: stage and micro-batch) keeps `nbytes` for its backward."""
        self.live += nbytes - self._held.get(key, 0)
        self._held[key] = nbytes
        self.peak = max(self.peak, self.live)

    def release(self, key: Any) -> None:
        """`key`'s backward has run: what it kept is freed."""
        self.live -= self._held.pop(key, 0)


class SavedShapes:
    """The bytes a stage's forward saves, remembered per input shapes where its graph saves the
    same tensors for the same shapes (see the module); `None` from `get`: count this forward."""

    def __init__(self, module: fx.GraphModule) -> None:
        self.fixed = fixed_saves(module)
        self._bytes: dict[Hashable, int] = {}

    def key(self, values: Iterable[Any]) -> Hashable | None:
        """The shapes and dtypes of the tensors among `values` (nested), in order; None where the
        stage's saves are not fixed by its shapes (nothing is remembered, nothing to compute)."""
        if not self.fixed:
            return None
        return tuple((t.shape, t.dtype) for t in pytree.tree_leaves(list(values)) if isinstance(t, torch.Tensor))

    def get(self, key: Hashable | None) -> int | None:
        return None if key is None else self._bytes.get(key)

    def remember(self, key: Hashable | None, nbytes: int) -> None:
        if key is not None:
            self._bytes[key] = nbytes


def fixed_saves(module: fx.GraphModule) -> bool:
    """Whether a stage graph saves the same tensors whenever its inputs have the same shapes: no
    module kept whole (`plait::kept`), and every module it calls one of torch's own."""
    for node in module.graph.nodes:
        if node.op == "call_function" and "plait.kept" in str(node.target):
            return False
        if node.op == "call_module" and not type(module.get_submodule(str(node.target))).__module__.startswith("torch."):
            return False
    return True
