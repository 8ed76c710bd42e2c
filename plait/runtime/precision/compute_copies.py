"""`ComputeCopies`: the low-precision copies of a rank's parameters its stages compute with, over fp32 master weights.

Mixed precision as FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` and
Megatron's bf16 training have it (`Plan.precision`):

    master  the model's own fp32 parameter: the optimizer steps it, the data-parallel and tied
            sums, ZeRO, checkpoints and state_dict() see it, as in an fp32 run
    copy    a bf16 parameter of the same shape, in a copy of the stage module's tree (the
            model's modules are never touched), refreshed from the master before every step
    grad    each backward that reaches a copy adds its gradient into the master's fp32 `.grad`
            (a post-accumulate hook: once per micro-batch, as autograd accumulates) and clears the
            copy's; then the master's gradient listeners run (`after_grad`: the buckets)

The copies' values are the masters' rounded: the stages compute exactly what a bf16 copy of the
model computes in one process, and the update is the fp32 one.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import fx, nn

from plait.capture.compute_dtype import cast_floating
from plait.capture.split import StageModule

__all__ = ["ComputeCopies", "GradListener"]

GradListener = Callable[[torch.Tensor], None]


class ComputeCopies:
    """The copies of one rank (shared by its training and evaluation stages), by master."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._copies: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(master) -> (master, copy)
        self._masters: dict[int, nn.Parameter] = {}  # id(copy) -> master
        self._listeners: dict[int, list[GradListener]] = {}

    def stage(self, stage: StageModule, only: set[int] | None = None) -> StageModule:
        """`stage` computing with the copies: its module tree copied (every module a new object with
        its own parameter dict; buffers shared with the model, so in-place updates reach it). With
        `only` (ids), only those parameters get a copy; the others stay the masters (zero=3: FSDP2
        casts them itself, `plait.runtime.dp.sharded_params`)."""
        return replace(stage, module=self._tree(stage.module, {}, only))

    def _tree(self, module: nn.Module, memo: dict[int, nn.Module], only: set[int] | None) -> Any:
        if id(module) in memo:  # a module reached twice (reused) stays one module
            return memo[id(module)]
        # a plain shallow copy (GraphModule's __copy__ would re-own its graph); a GraphModule gets a class
        # of its own (its generated forward is the class's) and a copy of the graph, so a rewrite of the
        # copy (batched weight gradients) leaves the model's stage as it is
        graph = isinstance(module, fx.GraphModule)
        made: Any = fx.GraphModule.__new__(type(module)) if graph else object.__new__(type(module))  # type: ignore[type-var]
        made.__dict__.update(module.__dict__)
        memo[id(module)] = made
        made.__dict__["_parameters"] = {name: p if p is None or (only is not None and id(p) not in only)
                                        else self._copy_of(p) for name, p in module._parameters.items()}
        made.__dict__["_buffers"] = dict(module._buffers)
        made.__dict__["_modules"] = {name: None if m is None else self._tree(m, memo, only)
                                     for name, m in module._modules.items()}
        if graph:
            made.graph = copy.deepcopy(module.graph)
        return made

    def _copy_of(self, master: nn.Parameter) -> nn.Parameter:
        if id(master) in self._copies:
            return self._copies[id(master)][1]
        if not master.is_floating_point():
            return master
        low = nn.Parameter(master.detach().to(self.dtype), requires_grad=master.requires_grad)
        if master.requires_grad:
            low.register_post_accumulate_grad_hook(lambda p, m=master: self._to_master(m, p))  # type: ignore[no-untyped-call]
        self._copies[id(master)] = (master, low)
        self._masters[id(low)] = master
        return low

    def _to_master(self, master: nn.Parameter, low: torch.Tensor) -> None:
        """Add the copy's gradient into the master's fp32 one, then run the master's listeners."""
        grad, low.grad = low.grad, None
        if grad is not None:
            self._add(master, grad)

    def add_wide(self, low: torch.Tensor, grad: torch.Tensor) -> None:
        """Add `grad`, copy `low`'s gradient computed in fp32 (the batched weight gradients of
        `plait.runtime.batched_wgrad`: Megatron's gradient-accumulation fusion), into its master's
        fp32 one, then run the master's listeners. In fp16 a value past fp16's range is made inf,
        as the copy's own fp16 gradient would be, so the loss scale sees the overflow."""
        if self.dtype == torch.float16:
            grad = grad.masked_fill(grad.abs() > torch.finfo(torch.float16).max, float("inf"))
        self._add(self._masters[id(low)], grad)

    def holds(self, low: torch.Tensor) -> bool:
        """Whether `low` is one of the copies."""
        return id(low) in self._masters

    def _add(self, master: nn.Parameter, grad: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)
        for listen in self._listeners.get(id(master), ()):
            listen(master)

    def after_grad(self, param: nn.Parameter, listen: GradListener) -> None:
        """Call `listen(param)` each time a gradient is added into `param`'s `.grad` (what a
        post-accumulate hook on an fp32 run's parameter sees)."""
        if id(param) in self._copies:
            self._listeners.setdefault(id(param), []).append(listen)
        else:  # a parameter without a copy (not floating, or on no stage of this rank) computes itself
            param.register_post_accumulate_grad_hook(listen)  # type: ignore[no-untyped-call]

    def refresh(self) -> None:
        """Every copy takes its master's current value (after an optimizer step, a load, a replan),
        its memory given back first where `release` freed it."""
        with torch.no_grad():
            for master, low in self._copies.values():
                storage = low.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(low.numel() * low.element_size())
                low.copy_(master)

    def release(self) -> None:
        """Free every copy's memory (storage resized to nothing; `refresh` fills it again): zero=3's
        evaluation copies, held only while the whole parameters are gathered."""
        for _, low in self._copies.values():
            low.untyped_storage().resize_(0)

    @property
    def copy_ids(self) -> set[int]:
        """The ids of the copies made."""
        return {id(low) for _, low in self._copies.values()}

    def inputs(self, values: Any) -> Any:
        """A stage's inputs from the batch, floating ones in the compute dtype."""
        return cast_floating(values, self.dtype)

    @staticmethod
    def outputs(values: Any) -> Any:
        """The model's outputs, floating ones in fp32 (the loss and the user see fp32)."""
        return cast_floating(values, torch.float32)

    @property
    def copy_bytes(self) -> int:
        """Bytes of the copies held (the memory low precision adds beside the masters; a released
        copy holds none)."""
        return sum(low.untyped_storage().nbytes() for _, low in self._copies.values())
