"""Weight gradients of linear layers computed once per step over all micro-batches.

Micro-batching cuts every weight gradient into m small GEMMs: for a Linear(512, 512) and
micro-batches of 8 rows, dW_k = dY_k^T X_k is a [512, 8] x [8, 512] product whose 1 MB result
is written, then added into `.grad`, m times a step. On a CPU these passes over memory cost more
than the arithmetic. With `Config(batch_weight_grads=True)` each linear of a stage keeps its
micro-batches' inputs X_k and output gradients dY_k and, at the end of the stage's program,
computes the step's gradient in one GEMM over all rows:

    micro-batch k:   B: dX_k = dY_k W          (sent upstream at once, as before)
                        keep (X_k, dY_k)
    end of step:     dW = [dY_0; ...; dY_m-1]^T [X_0; ...; X_m-1]     db = sum of all rows of dY

The stage's fx graph (plait's own copy, not the user's model) has its `aten.linear` calls
replaced by a module whose autograd function returns no gradient for the weight and bias; the
batched gradient is then accumulated through autograd (`backward` on the parameter), so
post-accumulate hooks (data-parallel buckets) fire once, as for any gradient. Only linears whose
weight and bias are used by that one call are rewritten (a tied weight keeps the ordinary path).
Memory: X_k and dY_k of every linear stay until the end of the step (GPipe keeps X_k anyway).

In low precision (the stage computes with bf16 or fp16 copies, `plait.runtime.precision`) the
step's dW and db are computed in fp32 from the low-precision X_k and dY_k and added straight into
the fp32 master gradients (`ComputeCopies.add_wide`), as Megatron's gradient-accumulation fusion
accumulates its weight-gradient GEMMs into fp32 main gradients: no per-micro-batch rounding to bf16.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn

__all__ = ["WeightBatch", "defer_linear_weight_grads"]


class WeightBatch:
    """The (input, output gradient) pairs of one stage's linears for the current step."""

    def __init__(self) -> None:
        # low precision (set by the stage's executor): (parameter, its fp32 gradient) -> added into its
        # fp32 sum (`ComputeCopies.add_wide`, or zero=3's `ShardedParameters.add_wide`)
        self.add_wide: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        # One leaf per rewritten linear: a split backward (ZB-H1) treats them as the weights its
        # W must reach, so a linear off the input's path still runs its backward (in W).
        self.anchors: list[torch.Tensor] = []
        self._pending: dict[int, tuple[nn.Parameter, nn.Parameter | None, list[torch.Tensor], list[torch.Tensor]]] = {}

    def keep(self, weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, grad_y: torch.Tensor) -> None:
        entry = self._pending.setdefault(id(weight), (weight, bias, [], []))
        entry[2].append(x.reshape(-1, x.shape[-1]))  # (rows, in)
        entry[3].append(grad_y.reshape(-1, grad_y.shape[-1]))  # (rows, out)

    def flush(self) -> None:
        """Accumulate every kept linear's gradient of the step: one GEMM per weight."""
        pending, self._pending = self._pending, {}
        for weight, bias, xs, gys in pending.values():
            x = torch.cat(xs) if len(xs) > 1 else xs[0]  # (all rows, in)
            gy = torch.cat(gys) if len(gys) > 1 else gys[0]  # (all rows, out)
            if self.add_wide is None:
                _StepGrad.apply(x, gy, weight, bias).backward()  # type: ignore[no-untyped-call]
                continue
            wide = gy.float()
            self.add_wide(weight, wide.t().mm(x.float()))
            if bias is not None:
                self.add_wide(bias, wide.sum(0))

    def clear(self) -> None:
        self._pending.clear()


class _StepGrad(torch.autograd.Function):
    """The step's dW = gy^T x (and db, the row sum of gy) as the backward of a node on the
    weight and bias. Made inside the backward, the gradient is held by autograd alone, so
    AccumulateGrad takes the tensor as `.grad`; one passed to `torch.autograd.backward` is
    still held by the caller and is copied (a 1 MB copy per Linear(512, 512) and step)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gy: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, gy)
        ctx.has_bias = bias is not None
        return x.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        x, gy = ctx.saved_tensors
        return None, None, gy.t().mm(x), gy.sum(0) if ctx.has_bias else None  # (out, in), (out,)


class _LinearFn(torch.autograd.Function):
    """Linear with no autograd edge to its weight and bias (they come in detached): nothing
    accumulates into them, and no hook of theirs fires, until `WeightBatch.flush`. `anchor`, a
    leaf that requires grad, makes the output require grad even when `x` does not."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                anchor: torch.Tensor, module: "_DeferredLinear", live: tuple[Any, Any]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.kept, ctx.live = module, False, live
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        if not ctx.kept:  # a split backward may run this node again for its W: keep once
            ctx.kept = True
            ctx.module.batch.keep(*ctx.live, x.detach(), grad_y.detach())
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None, None


class _DeferredLinear(nn.Module):
    """`aten.linear(x, weight, bias)` whose weight gradient goes to a `WeightBatch`."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    batch: WeightBatch
    anchor: torch.Tensor

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, batch: WeightBatch):
        super().__init__()
        # Plain attributes, not registered: the stage's parameters stay the user's module's.
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "bias", bias)
        object.__setattr__(self, "batch", batch)
        object.__setattr__(self, "anchor", torch.zeros((), requires_grad=True))

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return torch.nn.functional.linear(x, weight, bias)
        # (`live`: the parameters this forward read, in a tuple autograd does not look into: with zero=3
        # they are the ones FSDP2 gathered, whose gradients it reduce-scatters)
        out: torch.Tensor = _LinearFn.apply(  # type: ignore[no-untyped-call]
            x, weight.detach(), None if bias is None else bias.detach(), self.anchor, self, (weight, bias))
        return out


def defer_linear_weight_grads(module: fx.GraphModule) -> WeightBatch | None:
    """Rewrite `module`'s linears whose weight (and bias) nothing else uses, and those of the graphs it
    calls (zero=3's layer pieces); None if there are none."""
    batch = WeightBatch()
    graphs = [m for m in module.modules() if isinstance(m, fx.GraphModule)]  # (listed before any is rewritten)
    count = sum(_rewrite(m, batch) for m in graphs)
    return batch if count else None


def _rewrite(module: fx.GraphModule, batch: WeightBatch) -> int:
    """`module`'s own linears rewritten to keep their weight gradients in `batch`; how many."""
    users_of: dict[fx.Node, int] = {n: len(n.users) for n in module.graph.nodes}
    count = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        weight = _parameter(module, node.args[1] if len(node.args) > 1 else None)
        bias_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        bias = _parameter(module, bias_node)
        if weight is None or users_of[node.args[1]] != 1 or (bias_node is not None and (
                bias is None or users_of[bias_node] != 1)):
            continue
        name = f"plait_deferred_linear_{count}"
        count += 1
        deferred = _DeferredLinear(weight, bias, batch)
        batch.anchors.append(deferred.anchor)
        module.add_submodule(name, deferred)
        with module.graph.inserting_before(node):
            call = module.graph.call_module(name, (node.args[0], node.args[1], bias_node))
        call.meta.update(node.meta)  # (its layer: where zero=3 and recomputation cut the stage)
        node.replace_all_uses_with(call)
        module.graph.erase_node(node)
    if count:
        module.graph.lint()
        module.recompile()
    return count


def _parameter(module: fx.GraphModule, node: Any) -> nn.Parameter | None:
    """The parameter a `get_attr` node reads (split stages read every parameter that way)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    try:
        return module.get_parameter(str(node.target))
    except AttributeError:  # a buffer or a constant, not a parameter
        return None
