"""`LayerRuns`: each captured layer run alone as a stage, and the whole model as one stage, timed on one sample."""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from plait import data as batching
from plait.capture.split import StageModule, split
from plait.runtime.comm.wire import as_received
from plait.runtime.executor import StageExecutor, grad_leaves
from plait.runtime.memory.activation_meter import SavedBytes

__all__ = ["LayerRuns", "scale_to_whole", "tensor_bytes", "HELD"]

HELD = 2  # micro-batches the whole-model pass keeps alive at once, as a pipeline stage does


class LayerRuns:
    """The per-layer chain on one sample: each layer's inputs, then its timings on demand.

    Every layer runs as the runtime runs a stage, through `StageExecutor` (in-place writes to
    received values, modules kept whole, the loss on the last stage, B and W as a zero-bubble
    schedule splits them), on inputs made as the wire delivers them (`as_received`: detached
    leaves in the sender's strides); the whole pass is one stage of every layer.
    """

    def __init__(self, captured: Any, stages: Sequence[StageModule], args: tuple[Any, ...],
                 kwargs: dict[str, Any], rows: int, options: Any) -> None:
        # options: the profile's `plait.planner.profile.ProfileOptions` (which imports this module)
        self.stages, self.repeats, self.rows = stages, options.repeats, rows
        self.slowest = options.slowest
        target = options.target
        if options.loss is not None and target is not None:
            loss, self.target = options.loss, batching.slice_rows(target, 0, rows)
        else:  # random output gradients: the gradient of a random projection of the outputs
            loss, self.target = _projection, torch.zeros(rows)
        self.executors = [StageExecutor(st, captured.finish, loss) for st in stages]
        whole = split(captured, [0] * len(captured.layers.layer_names))[0]
        self.whole_stage = StageExecutor(whole, captured.finish, loss)
        model_inputs = captured.bind(args, kwargs)
        self.whole_inputs = [model_inputs[j] for j in whole.input_indices]
        self.inputs: list[tuple[list[Any], list[Any]]] = []  # (received, model inputs) per layer
        self.saved: list[float] = []
        self.sent: list[float] = []
        received: list[Any] = []
        for st, ex in zip(stages, self.executors):
            mine = [model_inputs[j] for j in st.input_indices]
            self.inputs.append((as_received(received), mine))
            with SavedBytes(st.module.parameters()) as saved:  # as the runtime's meter counts them
                out = ex.forward(0, self.inputs[-1][0], mine, self.target)
            ex.reset()
            self.saved.append(float(saved.total))
            if st.is_last:  # nothing crosses; what the stage hands to `finish`
                with torch.no_grad():
                    out = ex.module_outputs(self.inputs[-1][0], mine)
            self.sent.append(float(tensor_bytes(out)))
            received = out

    def measure(self) -> tuple[list[dict[str, float]], tuple[float, float]]:
        """Per layer, the median over repeats of its F, B and W, each repeat's scaled to that
        repeat's whole-model pass (`scale_to_whole`); and the median scales (forward, backward).

        Each repeat times every layer, then the whole model, within a second or so: on a machine
        whose speed drifts (a shared host), both move alike and the median keeps a typical repeat.
        With `slowest`, a repeat's whole-model times are the slowest rank's.
        """
        self.sample_layers(), self.whole()  # warm-up
        kept: list[dict[str, list[float]]] = [{k: [] for k in ("f", "b", "w")} for _ in self.stages]
        scales = []
        for _ in range(self.repeats):
            layers = self.sample_layers()
            forward, backward = self.whole()
            if self.slowest is not None:
                forward, backward = self.slowest([forward, backward])
            scale = scale_to_whole(layers, (forward, backward))
            scales.append(scale)
            for acc, t in zip(kept, layers):
                for k in ("f", "b", "w"):
                    acc[k].append(t[k] * scale[k != "f"])
        return ([{k: statistics.median(v) for k, v in acc.items()} for acc in kept],
                (statistics.median(s[0] for s in scales), statistics.median(s[1] for s in scales)))

    def sample_layers(self) -> list[dict[str, float]]:
        return [self.sample(i) for i in range(len(self.stages))]

    def sample(self, i: int) -> dict[str, float]:
        """One measurement of layer i alone, as a zero-bubble stage runs it: forward (F), the
        input gradients (B), then the weight gradients (W), from random output gradients."""
        ex = self.executors[i]
        received, mine = self.inputs[i]
        start = time.perf_counter()
        out = ex.forward(0, received, mine, self.target)
        mid = time.perf_counter()
        grads = [torch.randn_like(t) for t in grad_leaves(out)]
        ex.backward_input(0, grads)
        after_b = time.perf_counter()
        ex.backward_weight(0)
        end = time.perf_counter()
        ex.reset()
        for x in grad_leaves(received):
            x.grad = None  # a stage that cannot split its backward accumulates into its leaves
        # by construction: no received gradient leaf, no B (the executor defers the whole
        # backward to W); no trainable weight, no W (what is left is timer noise)
        has_b = bool(grad_leaves(received))
        has_w = any(p.requires_grad for p in ex.stage.module.parameters())
        return {"f": mid - start, "b": after_b - mid if has_b else 0.0, "w": end - after_b if has_w else 0.0}

    def whole(self, held: int = HELD) -> tuple[float, float]:
        """Seconds per micro-batch of the forward, and of the backward (input and weight
        gradients), through every layer as one stage runs them: `held` copies of the sample
        forward, their graphs kept, then each one's backward."""
        ex = self.whole_stage
        copies = [pytree.tree_map(_copy, self.whole_inputs) for _ in range(held)]
        start = time.perf_counter()
        for k, mine in enumerate(copies):
            ex.forward(k, [], mine, self.target)
        mid = time.perf_counter()
        for k in range(held):
            ex.backward(k, [])
        end = time.perf_counter()
        ex.reset()
        return (mid - start) / held, (end - mid) / held


def _projection(output: Any, target: Any) -> torch.Tensor:
    """A random projection of the outputs that carry gradients: its gradient is a random output
    gradient, the profile's backward when no loss is given."""
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return torch.zeros((), requires_grad=True)
    return torch.stack([(t * torch.randn_like(t)).sum() for t in leaves]).sum()


def _copy(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def scale_to_whole(layer_times: list[dict[str, float]], whole: tuple[float, float]) -> tuple[float, float]:
    """Whole-model forward, and backward, over the sums of the layers' F, and B + W (1 where
    either is 0).

    A layer timed alone, again and again, finds its inputs and weights in cache; the whole
    model, on fresh micro-batches whose activations stay alive, streams through memory as a
    pipeline stage does. Scaling each layer by these factors keeps the layers' relative costs
    and makes their sums what a stage really spends.
    """
    f = sum(t["f"] for t in layer_times)
    bw = sum(t["b"] + t["w"] for t in layer_times)
    return (whole[0] / f if f > 0 and whole[0] > 0 else 1.0,
            whole[1] / bw if bw > 0 and whole[1] > 0 else 1.0)


def tensor_bytes(values: Any) -> int:
    """Bytes of the tensors in `values` (any nesting of lists, tuples and dicts)."""
    leaves = pytree.tree_leaves(values)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
