"""`StageExecutor`: one stage's forward and backward for each micro-batch, with what it keeps between.

The received activations become leaves that require grad -- the nkflow "gradient layer": in the
forward pass it is the identity, in the backward pass its `.grad` is dL/d(input), which is sent
upstream. Scaling each micro-batch's loss by its share of the batch makes the accumulated
gradients those of the whole batch's mean loss.

With `recompute=True` the stage keeps only its inputs: the forward runs under
`torch.utils.checkpoint` (non-reentrant, RNG state restored, so dropout draws the same mask)
and is run again when the backward needs its activations. Given its layers' pieces
(`layer_pieces`), it recomputes layer by layer instead (`plait.runtime.layer_checkpoint`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

from plait.capture.split import StageModule
from plait.errors import ConfigError, LossError
from plait.runtime.backward_split import SplitPlans, WeightGradients, backward_input
from plait.runtime.batched_wgrad import WeightBatch, defer_linear_weight_grads
from plait.runtime.layer_checkpoint import layer_checkpointed
from plait.runtime.precision.compute_copies import ComputeCopies
from plait.runtime.memory.activation_meter import ActivationMeter, SavedBytes, SavedShapes, hooks_in_use

__all__ = ["StageExecutor", "grad_leaves"]


def grad_leaves(values: list[Any]) -> list[torch.Tensor]:
    """The tensors among `values` that carry gradients, in a fixed order both peers agree on."""
    leaves, _ = pytree.tree_flatten([tuple(v) if isinstance(v, torch.Size) else v for v in values])
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


class StageSharding(Protocol):
    """zero=3's sharded parameters as a stage's executor sees them (`plait.runtime.dp.sharded_params`)."""

    sums_at_end: bool  # weight gradients come after the backward (split, or batched): summed at the batch's end

    def add_wide(self, param: torch.Tensor, grad: torch.Tensor) -> None: ...

    def before_backward(self, stage_index: int) -> None: ...

    def after_backward(self, stage_index: int) -> None: ...

    def after_weights(self, stage_index: int) -> None: ...

    def graph_parameters(self, stage_index: int) -> list[torch.Tensor]: ...


class StageExecutor:
    """Runs one stage module micro-batch by micro-batch."""

    def __init__(
        self,
        stage: StageModule,
        finish: Callable[[Any], Any],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        recompute: bool = False,
        batch_weight_grads: bool = False,
        meter: ActivationMeter | None = None,
        split_loss: Any = None,
        layer_pieces: Sequence[int] | None = None,
        copies: ComputeCopies | None = None,
        sharded: StageSharding | None = None,
        weight_batch: WeightBatch | None = None,
        compile_backend: str | None = None,
    ):
        self.stage = stage
        # torch.compile's: the stage's graph (or its pieces, recomputed layer by layer), made at first use
        self.compile_backend = compile_backend
        self._compiled: dict[int, Any] = {}
        if compile_backend is not None and (sharded is not None or batch_weight_grads or weight_batch is not None):
            raise ConfigError(f"compile={compile_backend!r} runs neither with zero=3 nor with batch_weight_grads "
                              "(a replayed plan or checkpoint holds one of them): set Config(zero=..., "
                              "batch_weight_grads=False) to run it compiled, or compile=False")
        self.sharded = sharded  # zero=3: told of each backward (and, a split one, of the batch's end)
        self.copies = copies  # low precision: the batch's floating inputs cast in, the model's outputs to fp32
        self.loss_scale = 1.0  # each loss's multiplier before its backward: fp16's scale / accumulate_steps
        # tp > 1, the training pipeline's last stage: its split outputs' loss (`plait.runtime.tp.vocab_loss`)
        self.split_loss = split_loss
        self.meter = meter  # this rank's bytes held for backward passes (training forwards add to it)
        self._saved = SavedShapes(stage.module) if meter is not None else None
        self._params = list(stage.module.parameters())
        self.recompute = recompute
        # Linear weight gradients kept per micro-batch and computed once at the step's end.
        # (zero=3: rewritten before FSDP2 took the stage's pieces, `weight_batch`)
        self.weight_batch = weight_batch if weight_batch is not None else (
            defer_linear_weight_grads(stage.module) if batch_weight_grads else None)
        if self.weight_batch is not None:
            self.weight_batch.add_wide = _wide_adder(copies, sharded)
        # recomputed layer by layer: the stage's graph in pieces (each layer's piece index given)
        self._layered = (layer_checkpointed(stage.module, layer_pieces)
                         if recompute and layer_pieces is not None else None)
        self._weights: dict[int, WeightGradients] = {}
        self._splits = SplitPlans()  # the B/W analysis of the stage's graph, by its shape
        self.finish = finish
        self.loss_fn = loss_fn
        self._inputs: dict[int, list[torch.Tensor]] = {}
        self._outputs: dict[int, list[torch.Tensor]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self.losses: dict[int, float] = {}  # micro-batch -> its (unscaled) mean loss, this step
        self.outputs: dict[int, Any] = {}  # micro-batch -> model output (last stage)

    def forward(
        self,
        microbatch_index: int,
        received: list[Any],
        inputs: list[Any],
        target: Any = None,
        scale: float = 1.0,
        train: bool = True,
        keep_output: bool = False,
    ) -> list[Any]:
        """Run the stage; return what goes to the next stage (empty on the last stage)."""
        if not (train and self.meter is not None) or hooks_in_use():
            if train and self.meter is not None:
                self.meter.blind = True  # the caller's saved-tensor hooks stay in charge
            return self._forward(microbatch_index, received, inputs, target, scale, train, keep_output)
        assert self._saved is not None
        key = self._saved.key([*received, *inputs])
        nbytes = self._saved.get(key)
        if nbytes is not None:  # counted at an earlier forward of these shapes
            out = self._forward(microbatch_index, received, inputs, target, scale, train, keep_output)
        else:
            with SavedBytes(self._params) as saved:
                out = self._forward(microbatch_index, received, inputs, target, scale, train, keep_output)
            saved.add(received)  # kept as the gradient leaves, whether autograd saved them or not
            nbytes = saved.total
            self._saved.remember(key, nbytes)
        self.meter.hold((self.stage.stage_index, microbatch_index), nbytes)
        return out

    def _forward(self, microbatch_index: int, received: list[Any], inputs: list[Any], target: Any,
                 scale: float, train: bool, keep_output: bool) -> list[Any]:
        if self.copies is not None:
            inputs = self.copies.inputs(inputs)
        with torch.set_grad_enabled(train):
            if train and self._layered is not None:
                out = self._run(*received, *inputs, module=self._layered)
            elif train and self.recompute:
                out = checkpoint(self._run, *received, *inputs, use_reentrant=False)
            else:
                out = self._run(*received, *inputs)
            if not self.stage.is_last:
                values = list(out)
                if train:
                    self._inputs[microbatch_index] = grad_leaves(received)
                    self._outputs[microbatch_index] = grad_leaves(values)
                return values
            if self.copies is not None:
                out = self.copies.outputs(out)
            split = self.split_loss
            if split is not None and (keep_output or self.loss_fn is None or target is None):
                out, split = split.gathered(list(out)), None  # the outputs are wanted whole
            output = self.finish(out) if split is None else None
            if keep_output:
                self.outputs[microbatch_index] = pytree.tree_map(
                    lambda x: x.detach() if isinstance(x, torch.Tensor) else x, output
                )
            if self.loss_fn is not None and target is not None:
                loss = split(list(out), target) if split is not None else self.loss_fn(output, target)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                    raise LossError(
                        f"the loss returned {shape}, not a scalar tensor; plait needs a scalar "
                        "mean loss per batch (for torch.nn losses use reduction='mean')"
                    )
                self.losses[microbatch_index] = float(loss.detach())
                if train:
                    self._inputs[microbatch_index] = grad_leaves(received)
                    self._losses[microbatch_index] = loss * (scale * self.loss_scale)
            return []

    def _run(self, *args: Any, module: Any = None) -> Any:
        """The stage module (or `module`, its pieces) on `args`; a received tensor it writes in
        place is handed over as a copy, since autograd forbids writing the leaf whose gradient
        goes upstream (inside the checkpointed call, so a recomputation starts from the value
        received)."""
        written = self.stage.written_recv
        if written:
            args = tuple(a.clone() if i in written and isinstance(a, torch.Tensor) and a.requires_grad else a
                         for i, a in enumerate(args))
        module = self.stage.module if module is None else module
        if self.compile_backend is not None:
            if id(module) not in self._compiled:
                self._compiled[id(module)] = torch.compile(module, backend=self.compile_backend)
            module = self._compiled[id(module)]
        return module(*args)

    def module_outputs(self, received: list[Any], inputs: list[Any]) -> Any:
        """The stage module's own outputs on these values (before `finish` on the last stage),
        received values it writes in place handed over as copies, as in `forward`."""
        return self._run(*received, *inputs)

    def backward(self, microbatch_index: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Backpropagate one micro-batch; return dL/d(received tensors) for the previous stage."""
        inputs = self._inputs.pop(microbatch_index)
        if self.sharded is not None:
            self.sharded.before_backward(self.stage.stage_index)
        if self.stage.is_last:
            torch.autograd.backward(self._losses.pop(microbatch_index))
        else:
            outputs = self._outputs.pop(microbatch_index)
            if outputs:
                torch.autograd.backward(outputs, grads)
        self._release(microbatch_index)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]

    def backward_input(self, microbatch_index: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """B of a split backward: return dL/d(received tensors) now, keep the weight part for W.

        A recomputed stage runs its whole backward here (its W is empty): W runs one autograd
        call per group of weights, and each would recompute the checkpointed forward again. So
        does a compiled one: its backward is one node computing every gradient at once.
        """
        if self.recompute or self.compile_backend is not None:
            return self.backward(microbatch_index, grads)
        inputs = self._inputs.pop(microbatch_index)
        if self.sharded is not None:
            self.sharded.before_backward(self.stage.stage_index)
        if self.stage.is_last:
            outputs: list[torch.Tensor] = [self._losses.pop(microbatch_index)]
            out_grads: list[torch.Tensor | None] = [None]
        else:
            outputs, out_grads = self._outputs.pop(microbatch_index), list(grads)
        if not outputs:
            self._release(microbatch_index)
            return [torch.zeros_like(x) for x in inputs]
        params: list[torch.Tensor] = ([p for p in self.stage.module.parameters() if p.requires_grad]
                                      if self.sharded is None else self.sharded.graph_parameters(self.stage.stage_index))
        if self.weight_batch is not None:
            params += self.weight_batch.anchors
        input_grads, self._weights[microbatch_index] = backward_input(outputs, out_grads, inputs, params,
                                                                           self._splits)
        return input_grads

    def backward_weight(self, microbatch_index: int) -> None:
        """W of a split backward: accumulate this micro-batch's weight gradients."""
        weights = self._weights.pop(microbatch_index, None)
        if weights is not None:
            weights.run()
            if self.sharded is not None:
                self.sharded.after_weights(self.stage.stage_index)
        self._release(microbatch_index)

    def _release(self, microbatch_index: int) -> None:
        if self.meter is not None:
            self.meter.release((self.stage.stage_index, microbatch_index))

    @property
    def finishes(self) -> bool:
        """Whether `finish_step` has work: batched weight gradients, or zero=3's end of a split backward."""
        return self.weight_batch is not None or (self.sharded is not None and self.sharded.sums_at_end)

    def finish_step(self) -> None:
        """After the stage's last backward of a batch: the batched linear weight gradients, then
        zero=3's reduce-scatters where the backward was split (`StageSharding.after_backward`)."""
        if self.weight_batch is not None:
            self.weight_batch.flush()
        if self.sharded is not None and self.sharded.sums_at_end:
            self.sharded.after_backward(self.stage.stage_index)

    def reset(self) -> None:
        """Forget everything of the previous step."""
        if self.weight_batch is not None:
            self.weight_batch.clear()
        self._inputs.clear()
        self._outputs.clear()
        self._losses.clear()
        self._weights.clear()
        self.losses.clear()
        self.outputs.clear()


def _wide_adder(copies: ComputeCopies | None, sharded: StageSharding | None,
                ) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """Below fp32, where a batched weight gradient computed in fp32 goes: a copy's into its master
    (`ComputeCopies.add_wide`), a zero=3 piece's gathered parameter's into FSDP2's fp32 sum."""
    if copies is None:
        return None
    if sharded is None:
        return copies.add_wide

    to_copy, to_piece = copies.add_wide, sharded.add_wide

    def add(param: torch.Tensor, grad: torch.Tensor) -> None:
        (to_copy if copies.holds(param) else to_piece)(param, grad)

    return add
