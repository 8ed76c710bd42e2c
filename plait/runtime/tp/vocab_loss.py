"""The loss on logits split by vocabulary over the tp ranks: cross-entropy without gathering them.

The last stage's logits leave the stage graph split (each tp rank holds its vocabulary columns).
The user's loss is traced once per input shape (`make_fx` on meta tensors of the whole outputs);
where it is a cross-entropy over the split dimension,

    logits -> views, slices, copies -> log_softmax over the vocabulary -> nll_loss -> loss

it runs on this rank's part (Megatron-LM's vocabulary-parallel cross-entropy):

    log_softmax   m = the row's max (all-reduce MAX), s = sum of exp(x - m) over the part
                  (all-reduce SUM forward and backward: each rank's backward holds its own
                  targets' share of d loss / d s), log p = x - m - log s
    nll_loss      each target's log p picked by the rank holding its column, 0 elsewhere,
                  all-reduced; the mean over the targets not ignored

so the (rows x vocabulary) logits are never whole on a rank. A vocabulary that does not divide by
tp is cut unevenly (`plait.tensor_parts`: the last rank holds fewer columns): the max and the sums
above run over the columns each rank holds, the same numbers. Any other use of the split logits
(a label-smoothed or weighted loss, a metric, outputs kept for the caller): they are gathered
(all-gather) and the loss runs as written.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, cast

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from plait.capture.graph_nodes import reshape_dim
from plait.runtime.comm.waiting import finish
from plait.runtime.tp.tp_collectives import TpCollective, reduce_sum, sum_both_ways
from plait.tensor_parts import part_rows, part_size

__all__ = ["SplitLoss", "split_plan", "collectives_of"]

aten = torch.ops.aten
_SAME = {aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.alias.default,
         aten.detach.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
Step = tuple[str, Any]  # how one node runs on the parts: ("as is" | "view" | "log_softmax" | "nll", detail)


class SplitLoss:
    """The loss of the last stage's outputs, some of them split over the tp group (`split`: leaf
    index -> (dim, blocks)); see the module."""

    def __init__(self, finish: Callable[[Any], Any], loss_fn: Callable[[Any, Any], torch.Tensor],
                 split: dict[int, tuple[int, int, int]], group: Any, tp_rank: int, tp: int) -> None:
        self.finish, self.loss_fn, self.split = finish, loss_fn, split
        self.group, self.tp_rank, self.tp = group, tp_rank, tp
        self._plans: dict[Any, tuple[fx.GraphModule, dict[str, Step]] | None] = {}
        self.calls = {"split": 0, "gathered": 0}  # how the losses ran: on the parts, or gathered

    def gathered(self, leaves: list[Any]) -> list[Any]:
        """The outputs with every split leaf gathered whole (differentiably)."""
        out = list(leaves)
        for i, (dim, blocks, size) in self.split.items():
            out[i] = TpCollective("gather", self.group, self.tp_rank, self.tp, dim, blocks, size)(out[i])
        return out

    def __call__(self, leaves: list[Any], target: Any) -> torch.Tensor:
        plan = self._plan(leaves, target) if isinstance(target, torch.Tensor) else None
        self.calls["gathered" if plan is None else "split"] += 1
        if plan is None:
            return self.loss_fn(self.finish(self.gathered(leaves)), target)
        return self._run(*plan, leaves, target)

    # -- tracing -----------------------------------------------------------------------------------

    def _whole_shape(self, i: int, t: torch.Tensor) -> list[int]:
        shape = list(t.shape)
        if i in self.split:
            dim, _, size = self.split[i]
            shape[dim] = size or shape[dim] * self.tp
        return shape

    def _plan(self, leaves: list[Any], target: torch.Tensor) -> tuple[fx.GraphModule, dict[str, Step]] | None:
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        key = (tuple((i, tuple(leaves[i].shape), leaves[i].dtype) for i in tensors), tuple(target.shape), target.dtype)
        if key not in self._plans:
            self._plans[key] = self._trace(leaves, tensors, target)
        return self._plans[key]

    def _trace(self, leaves: list[Any], tensors: list[int], target: torch.Tensor,
               ) -> tuple[fx.GraphModule, dict[str, Step]] | None:
        metas = [torch.empty(self._whole_shape(i, leaves[i]), dtype=leaves[i].dtype, device="meta") for i in tensors]
        return split_plan(self.loss_fn, self.finish, leaves, dict(zip(tensors, metas)), self.split, self.tp, target)

    # -- running on the parts ------------------------------------------------------------------------

    def _run(self, gm: fx.GraphModule, steps: dict[str, Step], leaves: list[Any], target: torch.Tensor) -> torch.Tensor:
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)] + [target]
        return cast(torch.Tensor, _OnParts(gm, steps, self).run(*inputs))

    def log_softmax(self, x: torch.Tensor, dim: int, to_float: bool) -> torch.Tensor:
        """log_softmax over the split dimension `dim` of this rank's part (see the module)."""
        x = x.float() if to_float else x
        top = x.detach().amax(dim, keepdim=True)
        finish(dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        shifted = x - top
        total = sum_both_ways(shifted.exp().sum(dim, keepdim=True), self.group)
        return shifted - total.log()

    def nll(self, logp: torch.Tensor, vocabulary: int, target: torch.Tensor, weight: Any, reduction: int,
             ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """aten.nll_loss_forward of log-probabilities split over their last dimension (of
        `vocabulary` columns whole)."""
        columns = logp.shape[-1]
        local = target - part_rows(vocabulary, self.tp_rank, self.tp)[0]
        mine = (local >= 0) & (local < columns) & (target != ignore_index)
        picked = logp.gather(-1, local.clamp(0, columns - 1).unsqueeze(-1)).squeeze(-1) * mine
        picked = reduce_sum(picked, self.group)
        valid = (target != ignore_index).to(logp.dtype)
        count = valid.sum()
        if reduction == 0:
            return -picked, count
        if reduction == 1:
            return -picked.sum() / count, count
        return -picked.sum(), count


class _OnParts(fx.Interpreter):
    """The traced loss run on this rank's parts: the nodes `steps` names run their split form."""

    def __init__(self, gm: fx.GraphModule, steps: dict[str, Step], loss: SplitLoss) -> None:
        super().__init__(gm)
        self.steps, self.loss = steps, loss

    def run_node(self, n: fx.Node) -> Any:
        kind, detail = self.steps.get(n.name, ("as is", None))
        if kind == "as is":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if kind == "view":
            sizes = list(args[1])
            if sizes[detail] != -1:  # -1: inferred from the part
                sizes[detail] = part_size(sizes[detail], self.loss.tp_rank, self.loss.tp)
            return n.target(args[0], sizes, *args[2:], **kwargs)  # type: ignore[operator]
        if kind == "log_softmax":
            return self.loss.log_softmax(args[0], int(args[1]), bool(args[2]))
        return self.loss.nll(args[0], detail, *args[1:])


def split_plan(loss_fn: Callable[[Any, Any], torch.Tensor], finish: Callable[[Any], Any], leaves: list[Any],
               whole: dict[int, torch.Tensor], split: Mapping[int, tuple[int, ...]], tp: int, target: torch.Tensor,
               ) -> tuple[fx.GraphModule, dict[str, Step]] | None:
    """The loss traced on meta tensors of the `whole` outputs (leaf index -> meta tensor; the other
    leaves as they are) and how each node of it runs on the parts of those `split` ({leaf: (dim,
    blocks, ...)}), or None where it must run on gathered outputs (see the module)."""
    if any(cut[1] != 1 for cut in split.values()):
        return None
    tensors = sorted(whole)

    def loss_of(*args: torch.Tensor) -> torch.Tensor:
        out = list(leaves)
        for i, t in zip(tensors, args[:-1]):
            out[i] = t
        return loss_fn(finish(out), args[-1])

    try:
        gm = make_fx(loss_of)(*(whole[i] for i in tensors), torch.empty(target.shape, dtype=target.dtype, device="meta"))
    except Exception:  # noqa: BLE001 - a loss that cannot be traced runs as written, on whole outputs
        return None
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    start = {places[k].name: split[i][0] for k, i in enumerate(tensors) if i in split}
    steps = _steps(gm, start, tp)
    return (gm, steps) if steps is not None else None


def collectives_of(steps: dict[str, Step]) -> tuple[int, int]:
    """(forward, backward) all-reduces the split loss runs: a log-softmax's max and sum (and the
    sum's gradient), an nll_loss's picked values."""
    kinds = [kind for kind, _ in steps.values()]
    return 2 * kinds.count("log_softmax") + kinds.count("nll"), kinds.count("log_softmax")


def _steps(gm: fx.GraphModule, start: dict[str, int], tp: int) -> dict[str, Step] | None:
    """How each node touching the split logits runs on the parts, or None when some use of them is
    not a view, slice, copy, log-softmax over the split dimension or nll_loss of it."""
    split: dict[str, int] = dict(start)  # node name -> its split dimension
    steps: dict[str, Step] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        inputs = [n for n in node.all_input_nodes if n.name in split]
        if node.op == "output":
            return steps if not inputs else None
        if not inputs:
            continue
        if node.op != "call_function" or len(inputs) != 1 or inputs[0] is not node.args[0]:
            return None
        d, target = split[inputs[0].name], node.target
        if target in _SAME:
            split[node.name] = d
        elif target in _VIEWS:
            before, after = _shape(node.args[0]), _shape(node)
            e = reshape_dim(before, after, d, tp, 1) if before and after else None
            if e is None or after[e] != before[d]:
                return None
            split[node.name], steps[node.name] = e, ("view", e)
        elif target is aten.slice.Tensor and int(node.args[1]) % len(_shape(node)) != d:
            split[node.name] = d
        elif target is aten._log_softmax.default and int(node.args[1]) % len(_shape(node)) == d:
            split[node.name], steps[node.name] = d, ("log_softmax", d)
        elif (target is aten.nll_loss_forward.default and d == len(_shape(node.args[0])) - 1
              and node.args[2] is None):
            steps[node.name] = ("nll", _shape(node.args[0])[d])  # the vocabulary; its outputs are whole
        else:
            return None
    return None


def _shape(node: Any) -> list[int]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return [int(s) for s in val.shape] if isinstance(val, torch.Tensor) else []
