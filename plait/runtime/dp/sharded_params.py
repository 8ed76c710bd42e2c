"""`ShardedParameters`: each stage's parameters sharded over its replicas (ZeRO-3), by torch's FSDP2.

With `Config(zero=3)` the stage graph a rank runs is cut into its layers' pieces (as recomputation
layer by layer cuts it: `plait.runtime.layer_checkpoint`), each parameter one piece alone reads is
moved into that piece (`split_module` reads them all in the calling graph), each piece is handed to
`fully_shard` over the stage's data-parallel group, and the graph that calls the pieces is the
root, holding what several pieces read. FSDP2 then does what ZeRO-3 is (Rajbhandari et al. 2020):
each replica holds 1/dp of every parameter (dim 0); a piece's parameters are all-gathered just
before its forward and freed after it, gathered again for its backward, and its gradients
reduce-scattered to their owners once they are final, while the next piece computes.

    micro-batch 1 .. m-1   backward: gradients added up whole, no communication
    micro-batch m          backward: each piece's gradient reduce-scattered as its backward ends
    optimizer step         on this replica's shards only (parameters and state are 1/dp)

With a split backward (ZB-H1: B now, W later) a piece's gradients are final only after the step's
last W, so every B and W adds up whole (FSDP2's no-sync), a piece's gathered parameters are kept
from its B for the W (the next forward frees them), and after the last W every piece's post-backward
is run by hand -- the reduce-scatters -- as torch.distributed.pipelining does for FSDP2. W reaches the
gathered parameters FSDP2 made for the forward (`graph_parameters`); below fp32 each W's gradients
are folded into the fp32 sums at once (`after_weights`). Batched weight gradients likewise: the
pieces' linears (rewritten before FSDP2 takes them) keep their inputs and output gradients, the
step's GEMMs add into the gathered parameters' gradients (below fp32: in fp32 into FSDP2's sums,
`add_wide`), then the same reduce-scatters.

A model built on the meta device never holds its stage whole: its parameters are real but empty
until their piece is sharded (`plait.materialize.defer_parameters`); each piece's are given their
values just before `fully_shard` cuts them and freed right after, so a rank holds one layer's
whole parameters at a time (a real model's are freed piece by piece too).

A parameter tied across stages stays whole on every holder (`ignored_params`), summed by the tied
gradients' all-reduce as without ZeRO. The user's model keeps its parameter objects, their
storage freed (resized to nothing, shape kept, as FSDP2 frees an unsharded parameter);
`gathered()` fills them with the current whole values, for the state dict, the evaluation
pipeline and export, and frees them after. FSDP2 divides a reduce-scatter by the replicas by
default; plait's losses are already scaled by each replica's share of the batch, so the sum is
taken (`set_gradient_divide_factor(1.0)`, a plain SUM: gloo has no pre-multiplied one).

Below fp32 (`Plan.precision`) the shards are the fp32 masters and FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=float32)` makes the low copies: a piece
gathers its parameters rounded to the low dtype, each micro-batch's low gradient is added into an
fp32 sum (FSDP2's accumulated gradient), which is reduce-scattered in fp32 and stepped in fp32 --
what `plait.runtime.precision.compute_copies` does without ZeRO-3, so both train alike. A weight
tied across stages stays whole: it keeps a low copy of its own there.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.fx.passes.split_module import split_module

from plait.capture.split import StageModule
from plait.runtime.layer_checkpoint import layer_parts
from plait.tensor_parts import RowSpan, as_held, part_rows, row_span

__all__ = ["ShardedParameters"]


class ShardedParameters:
    """This rank's stages, their parameters sharded over the stage's replicas (`group`)."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype = torch.float32, offload: bool = False,
                 fill: Callable[[list[nn.Parameter]], object] | None = None, split_backward: bool = False,
                 batched: bool = False):
        self.mesh = DeviceMesh.from_group(group, device.type)
        # offload (Config.offload, on an accelerator): the shards, their gradients and the optimizer step in host memory
        self.offload: OffloadPolicy = CPUOffloadPolicy() if offload else OffloadPolicy()
        # below fp32: gathered in `dtype`; gradients added up and reduce-scattered in `reduce_dtype`
        low = dtype if dtype != torch.float32 else None
        self.policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce_dtype if low or
                                           reduce_dtype != torch.float32 else None)
        self.stages: dict[int, StageModule] = {}  # stage index -> the stage running on shards
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (the user's parameter, its shard)
        self._user_of: dict[int, nn.Parameter] = {}  # id(shard) -> the user's parameter (`pairs` by shard)
        self._backwards: dict[int, int] = {}  # stage index -> this batch's backward passes so far
        self._last = 0  # the backward pass whose gradients are reduce-scattered (0: none this batch)
        self._fill = fill  # a meta model's: gives parameters their values just before they are sharded
        self.split_backward = split_backward  # the schedule runs B and W apart: reduce-scatters at the step's end
        # weight gradients come after the backward (a split one's W, or batched at the step's end): every
        # backward adds up whole and `after_backward` reduce-scatters
        self.sums_at_end = split_backward or batched
        self._gathered_of: dict[int, Any] = {}  # id(a gathered parameter) -> its FSDPParam (`add_wide`)

    def stage(self, index: int, stage: StageModule, layer_pieces: Sequence[int], whole: set[int]) -> StageModule:
        """`stage` running with sharded parameters: its graph cut into its layers' pieces, each piece
        sharded, the graph calling them the root; the parameters in `whole` (ids: tied across
        stages) left whole. A piece reading a parameter another piece reads too is not sharded on
        its own: the root holds its parameters (gathered for the whole stage's forward)."""
        module = stage.module
        part = layer_parts(module.graph, layer_pieces)
        parent = module
        if len(set(part.values())) > 1:
            parent = split_module(module, module, part.__getitem__)
            _parameters_into_pieces(parent)
        slots = [(m, key, p) for m in parent.modules() for key, p in m._parameters.items() if p is not None]
        ignored = {p for _, _, p in slots if id(p) in whole}
        pieces = [child for name, child in parent.named_children() if name.startswith("submod_")]
        readers = Counter(id(p) for piece in pieces for p in piece.parameters())
        for piece in pieces:
            own = [p for p in piece.parameters() if p not in ignored]
            if own and all(readers[id(p)] == 1 for p in own):
                self._shard(piece, ignored, own)
        self._shard(parent, ignored, [p for p in parent.parameters() if p not in ignored and not isinstance(p, DTensor)])
        seen = {id(w) for w, _ in self.pairs}
        for m, key, p in slots:  # each of the user's parameters and the shard FSDP2 put in its place
            shard = m._parameters[key]
            if shard is not None and shard is not p and id(p) not in seen:
                seen.add(id(p))
                self.pairs.append((p, shard))
                self._user_of[id(shard)] = p
        self.stages[index] = replace(stage, module=parent)
        return self.stages[index]

    def _shard(self, module: nn.Module, ignored: set[nn.Parameter], wholes: list[nn.Parameter]) -> None:
        """`module` sharded by FSDP2; its `wholes` (the user's parameters it shards) given their values
        first where a meta model left them empty (`fill`), and freed once their rows are copied out:
        a rank holds one layer's whole parameters at a time, never its whole stage."""
        if self._fill is not None:
            self._fill(wholes)
        fully_shard(module, mesh=self.mesh, ignored_params=ignored or None, reshard_after_forward=True,
                    mp_policy=self.policy, offload_policy=self.offload)
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(1.0)  # the replicas' gradients summed (losses carry their share)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        for whole in wholes:
            _free(whole)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The sharded parameters (DTensors) the optimizer steps, once each."""
        return [shard for _, shard in self.pairs]

    def release(self) -> None:
        """Free the user's parameters' memory (their values live in the shards): the storage
        resized to nothing, shape and dtype kept, as FSDP2 frees an unsharded parameter."""
        for whole, _ in self.pairs:
            _free(whole)

    @contextlib.contextmanager
    def gathered(self, after: Callable[[], None] | None = None) -> Iterator[None]:
        """The user's parameters hold the whole current values (an all-gather over the replicas),
        freed again after (and `after()` called: what was made from them freed too)."""
        with torch.no_grad():
            for whole, shard in self.pairs:
                assert isinstance(shard, DTensor)
                whole.data = self._gathered(shard).contiguous()
        try:
            yield
        finally:
            self.release()
            if after is not None:
                after()

    def own_rows(self) -> dict[int, tuple[torch.Tensor, RowSpan]]:
        """id(the user's parameter) -> (this replica's rows of it, the rows of the whole tensor to read
        for them): where named weights and checkpoints are read into the shards directly."""
        out = {}
        for whole, shard in self.pairs:
            assert isinstance(shard, DTensor)
            out[id(whole)] = (shard.to_local(), row_span(whole, *self._rows(whole.shape[0])))
        return out

    def _rows(self, n: int) -> tuple[int, int]:
        """[start, stop) of this replica's rows of n (`torch.chunk`'s, as FSDP2 cuts dim 0)."""
        return part_rows(n, self.mesh.get_local_rank(), self.mesh.size())

    @staticmethod
    def rows(t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a sharded tensor (a shard, or its optimizer state); another as it is."""
        return t.to_local() if isinstance(t, DTensor) else t

    def held(self, shard: torch.Tensor, whole: torch.Tensor, span: RowSpan | None = None) -> torch.Tensor:
        """A whole value (a checkpoint's optimizer state) as `shard` holds it: this rank's rows of it
        (of its tp part where tp cut the parameter), the rows `torch.chunk` gives each replica as
        FSDP2 does; a value of another shape (a step count), or for a tensor not sharded, as it is.
        `span`: the value is the whole tensor's rows `rows_of` named, read so."""
        if span is not None and isinstance(shard, DTensor) and whole.dim():
            return DTensor.from_local(span.kept(whole).to(shard.to_local().device).contiguous(), shard.device_mesh,
                                      shard.placements, shape=shard.shape, stride=shard.stride())
        user = self._user_of.get(id(shard))
        if user is not None:
            whole = as_held(user, whole)
        if not isinstance(shard, DTensor) or tuple(whole.shape) != tuple(shard.shape) or whole.dim() == 0:
            return whole
        start, stop = self._rows(whole.shape[0])
        return DTensor.from_local(whole[start:stop].to(shard.to_local().device).contiguous(), shard.device_mesh,
                                  shard.placements, shape=shard.shape, stride=shard.stride())

    def rows_of(self, shard: torch.Tensor) -> RowSpan | None:
        """The rows of the whole tensor a checkpoint is read for to give this rank's `shard` (its rows,
        of its tp part where tp cut the parameter: `row_span`), or None: not a shard."""
        user = self._user_of.get(id(shard))
        if not isinstance(shard, DTensor) or user is None or not shard.dim():
            return None
        return row_span(user, *self._rows(shard.shape[0]))

    def whole_rows(self, optimizer: torch.optim.Optimizer | None) -> "WholeRows":
        """Every shard and every sharded optimizer state tensor gathered whole (an all-gather each, in
        the same order on every replica): what a checkpoint beside tp saves, as tp parts only."""
        gathered: dict[int, torch.Tensor] = {}
        for _, shard in self.pairs:
            assert isinstance(shard, DTensor)
            gathered[id(shard)] = self._gathered(shard)
        for group in optimizer.param_groups if optimizer is not None else ():
            for p in group["params"]:
                state = optimizer.state.get(p, {}) if optimizer is not None else {}
                for key in sorted(state):
                    if isinstance(state[key], DTensor):
                        gathered[id(state[key])] = self._gathered(state[key])
        return WholeRows(self.pairs, gathered)

    def _gathered(self, t: DTensor) -> torch.Tensor:
        """`t` whole, gathered on the ranks' device (an offloaded shard is in host memory)."""
        local = t.to_local()
        if local.device.type != self.mesh.device_type:
            t = DTensor.from_local(local.to(self.mesh.device_type), t.device_mesh, t.placements, shape=t.shape,
                                   stride=t.stride())
        return t.full_tensor()

    def prepare(self, num_microbatches: int, sync: bool) -> None:
        """Before a training batch of `num_microbatches`: each stage's gradients reduce-scattered in
        its last backward where `sync` (the last batch of a step), else only added up."""
        self._backwards = {s: 0 for s in self.stages}
        self._last = num_microbatches if sync else 0

    def before_backward(self, stage_index: int) -> None:
        """Before one micro-batch's backward (with a split backward: its B) of stage `stage_index`."""
        self._backwards[stage_index] = done = self._backwards.get(stage_index, 0) + 1
        root = self.stages[stage_index].module
        assert isinstance(root, FSDPModule)
        last = done == self._last and not self.sums_at_end
        root.set_requires_gradient_sync(last)
        root.set_is_last_backward(last)
        if self.split_backward:  # W comes later, on these gathered parameters: kept until the next forward frees them
            root.set_reshard_after_backward(False)

    def after_weights(self, stage_index: int) -> None:
        """After one micro-batch's W (a split backward): below fp32, the low-precision weight gradients it
        added are folded into FSDP2's fp32 sums at once, as a whole backward's post-backward does, so
        two W in a row never add their gradients in the low dtype."""
        if self.policy.reduce_dtype is None:  # (fp32: gradients add up in place, nothing to fold)
            return
        for fp in self._fsdp_params(stage_index):
            fp.accumulate_unsharded_grad_if_needed()
            fp.to_accumulated_grad_if_needed()

    def _fsdp_params(self, stage_index: int) -> list[Any]:
        """FSDP2's parameters (`FSDPParam`) of stage `stage_index`'s pieces that have been gathered."""
        root = self.stages[stage_index].module
        return [fp for piece in fully_shard.state(root)._state_ctx.all_states  # type: ignore[attr-defined]
                for group in piece._fsdp_param_groups for fp in group.fsdp_params if hasattr(fp, "_unsharded_param")]

    def graph_parameters(self, stage_index: int) -> list[torch.Tensor]:
        """The parameters a micro-batch's autograd graph of stage `stage_index` holds as its leaves (what
        a split backward's W accumulates into): each piece's gathered parameters, as FSDP2 made them
        for the forward and keeps them from step to step, and those left whole."""
        root = self.stages[stage_index].module
        out = [p for p in root.parameters() if p.requires_grad and not isinstance(p, DTensor)]
        return out + [fp.unsharded_param for fp in self._fsdp_params(stage_index) if fp.unsharded_param.requires_grad]

    def add_wide(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add `grad`, a gathered parameter's gradient computed in fp32 (batched weight gradients below
        fp32: `plait.runtime.batched_wgrad`), into FSDP2's fp32 sum of its gradients."""
        if id(param) not in self._gathered_of:  # (FSDP2 makes a gathered parameter once and keeps it)
            self._gathered_of = {id(fp.unsharded_param): fp for index in self.stages for fp in self._fsdp_params(index)}
        fp = self._gathered_of.get(id(param))
        if fp is None:
            raise KeyError("a batched weight gradient of a parameter no piece of this rank holds")
        summed = fp.unsharded_accumulated_grad
        fp.unsharded_accumulated_grad = grad if summed is None else summed + grad

    def after_backward(self, stage_index: int) -> None:
        """After a batch's last W or batched weight gradients of stage `stage_index`: on the step's last batch each
        piece's gradients reduce-scattered, as torch.distributed.pipelining does for FSDP2 (every piece's
        post-backward run by hand, then the root's final callback); every piece's parameters freed."""
        root = self.stages[stage_index].module
        assert isinstance(root, FSDPModule)
        if not self._last:  # a batch summed into a later step: the gradients stay added up whole
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            return
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        state = fully_shard.state(root)  # type: ignore[attr-defined]
        for piece in state._state_ctx.all_states:
            for group in piece._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


class WholeRows:
    """Shards and sharded state gathered whole (`ShardedParameters.whole_rows`), read in their place."""

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], gathered: dict[int, torch.Tensor]) -> None:
        self.pairs, self._gathered = pairs, gathered

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return self._gathered.get(id(t), t)

    def held(self, shard: torch.Tensor, whole: torch.Tensor, span: RowSpan | None = None) -> torch.Tensor:
        raise AssertionError("gathered rows are only saved")

    def rows_of(self, shard: torch.Tensor) -> RowSpan | None:
        raise AssertionError("gathered rows are only saved")


def _parameters_into_pieces(parent: fx.GraphModule) -> None:
    """`split_module` reads every parameter in the graph that calls the pieces and passes it in as
    an input: each parameter one piece alone reads moves into that piece (read there, registered
    there, gone from the caller), so that FSDP2 on the piece gathers it for that piece only."""
    graph = parent.graph
    for attr in [n for n in graph.nodes if n.op == "get_attr"]:
        path, _, name = str(attr.target).rpartition(".")
        owner = parent.get_submodule(path)
        value = owner._parameters.get(name)
        users = list(attr.users)
        if value is None or len(users) != 1 or users[0].op != "call_module" or users[0].kwargs:
            continue
        call = users[0]
        at = [i for i, a in enumerate(call.args) if a is attr]
        if len(at) != 1:
            continue
        piece = parent.get_submodule(str(call.target))
        assert isinstance(piece, fx.GraphModule)
        placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
        held = str(attr.target).replace(".", "_")
        piece.register_parameter(held, value)
        with piece.graph.inserting_after(placeholders[-1]):
            read = piece.graph.get_attr(held)
        placeholders[at[0]].replace_all_uses_with(read)
        piece.graph.erase_node(placeholders[at[0]])
        call.args = tuple(a for i, a in enumerate(call.args) if i != at[0])
        graph.erase_node(attr)
        del owner._parameters[name]
    for module in parent.modules():
        if isinstance(module, fx.GraphModule):
            module.graph.lint()
            module.recompile()


def _free(whole: torch.Tensor) -> None:
    """`whole`'s memory freed (storage resized to nothing, shape and dtype kept, as FSDP2 frees an
    unsharded parameter)."""
    if not whole.untyped_storage().resizable():  # `.numpy()` of it (an export) pins its storage
        whole.data = torch.empty_like(whole)
    whole.untyped_storage().resize_(0)
