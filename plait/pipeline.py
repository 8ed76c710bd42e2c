"""`Pipeline`: the captured model cut into stages, and this rank's share of running it.

Building one is the straight sequence of phases of the data flow:
capture -> partition (Plan) -> split into stage modules -> schedule programs -> executor/interpreter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from plait import data as batching
from plait.capture.output import OutputSpec, flatten_output
from plait.capture.split import StageModule, split, stage_of_layers
from plait.capture.trace import CapturedGraph, capture
from plait.config import Config
from plait.errors import PartitionError
from plait.plan import Plan, balance, check_partition
from plait.runtime.collectives import TiedGradients
from plait.runtime.executor import StageExecutor
from plait.runtime.interpreter import Interpreter
from plait.runtime.wire import Wire
from plait.schedule import Program, generate

__all__ = ["Pipeline", "build_pipeline"]

log = logging.getLogger("plait")


@dataclass
class Pipeline:
    """Everything one rank needs to run steps of one captured graph (train or eval)."""

    captured: CapturedGraph
    stages: list[StageModule]
    plan: Plan
    rank: int
    executor: StageExecutor
    interpreter: Interpreter
    ties: TiedGradients | None
    local_parameters: list[nn.Parameter]
    owner_of: dict[int, int]  # id(tensor) -> rank that trains it
    output_spec: OutputSpec
    layer_stage: list[int]
    _programs: dict[tuple[int, bool], Program] = field(default_factory=dict)

    @property
    def is_last(self) -> bool:
        return self.executor.stage.is_last

    @property
    def last_rank(self) -> int:
        return self.plan.stage_to_rank[-1]

    def program(self, num_microbatches: int, train: bool) -> Program:
        """This step's per-rank programs (generated and validated once per micro-batch count)."""
        key = (num_microbatches, train)
        if key not in self._programs:
            self._programs[key] = generate(
                self.plan.schedule, self.plan.num_stages, num_microbatches,
                forward_only=not train, stage_to_rank=dict(enumerate(self.plan.stage_to_rank)),
            )
        return self._programs[key]

    def for_eval(self, net: nn.Module, x: Any, loss: Callable[[Any, Any], torch.Tensor] | None) -> "Pipeline":
        """The same split for evaluation: torch.export bakes train/eval mode into the graph."""
        if self.captured.method != "torch.export":
            return self
        was_training = net.training
        net.eval()
        try:
            captured = capture(net, *batching.as_call(_sample(x)))
        finally:
            net.train(was_training)
        by_name = dict(zip(self.plan.layer_names, self.layer_stage))
        layer_stage, current = [], 0
        for name in captured.layers.layer_names:  # layers missing in train mode join their predecessor
            current = by_name.get(name, current)
            layer_stage.append(current)
        return _assemble(captured, layer_stage, self.plan, self.rank, loss, self.interpreter.wire,
                         ties=None, output_spec=self.output_spec)

    def share_from_last(self, leaves: list[Any] | None, key: Any) -> list[Any]:
        """Send the last stage's output leaves to every other rank (p2p, described once)."""
        wire = self.interpreter.wire
        if self.plan.world_size == 1:
            assert leaves is not None
            return leaves
        tag = 1 << 20
        if self.rank == self.last_rank:
            assert leaves is not None
            for r in range(self.plan.world_size):
                if r != self.rank:
                    wire.send(list(leaves), r, key, tag)
            wire.drain()
            return leaves
        values, _ = wire.recv(self.last_rank, key, tag)
        return values


def _sample(x: Any) -> Any:
    """Two rows of x (one duplicated if there is only one): a size-1 batch would fix dim 0."""
    rows = batching.num_rows(x)
    if rows >= 2:
        return batching.slice_rows(x, 0, 2)
    return batching.take(x, torch.tensor([0, 0]))


def build_pipeline(
    net: nn.Module,
    x: Any,
    num_stages: int,
    layers_per_stage: Sequence[int] | None,
    config: Config,
    rank: int,
    world_size: int,
    loss: Callable[[Any, Any], torch.Tensor] | None,
    train: bool,
    device: torch.device,
) -> Pipeline:
    """Capture `net` on a sample of `x`, partition it and make this rank's executor."""
    sample = _sample(x)
    args, kwargs = batching.as_call(sample)
    was_training = net.training
    net.train(train)
    try:
        captured = capture(net, args, kwargs)
    finally:
        net.train(was_training)
    with torch.no_grad(), torch.random.fork_rng():
        net.eval()
        try:
            _, output_spec = flatten_output(net(*args, **kwargs))
        finally:
            net.train(was_training)

    # partition
    names = captured.layers.layer_names
    regions = captured.layers.uncuttable
    if num_stages > len(names):
        raise PartitionError(
            f"{num_stages} stages but the model has only {len(names)} layers "
            f"({', '.join(names)}); use at most {len(names)} ranks"
        )
    if layers_per_stage is None:
        costs = [1.0 + _layer_params(net, name) for name in names]
        layers_per_stage = balance(costs, num_stages, regions)
    else:
        check_partition(layers_per_stage, names, regions)
    plan = Plan(
        layer_names=names,
        layers_per_stage=tuple(layers_per_stage),
        num_microbatches=config.num_microbatches,
        schedule=config.schedule,
        world_size=world_size,
        capture_method=captured.method,
        uncuttable=regions,
    )
    layer_stage = stage_of_layers(plan.layers_per_stage)
    wire = Wire(config.timeout_s, device)
    return _assemble(captured, layer_stage, plan, rank, loss, wire, ties="make", output_spec=output_spec)


def _layer_params(net: nn.Module, layer_name: str) -> float:
    module_name = layer_name.split("#")[0]
    try:
        module = net.get_submodule("" if module_name == "<net>" else module_name)
    except AttributeError:
        return 0.0
    return float(sum(p.numel() for p in module.parameters()))


def _assemble(
    captured: CapturedGraph,
    layer_stage: list[int],
    plan: Plan,
    rank: int,
    loss: Callable[[Any, Any], torch.Tensor] | None,
    wire: Wire,
    ties: Any,
    output_spec: OutputSpec,
) -> Pipeline:
    stages = split(captured, layer_stage)
    # Which stages hold each parameter/buffer: more than one means a tied (reused) parameter.
    holders: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for st in stages:
        for t in list(st.module.parameters()) + list(st.module.buffers()):
            if st.stage_index not in holders.setdefault(id(t), []):
                holders[id(t)].append(st.stage_index)
            tensors[id(t)] = t
    owner_of = {i: plan.stage_to_rank[min(s)] for i, s in holders.items()}
    params = {i: t for i, t in tensors.items() if isinstance(t, nn.Parameter)}
    my_stage = plan.stage_to_rank.index(rank)
    local = [p for p in stages[my_stage].module.parameters()]
    if ties == "make":
        names = {id(p): n for n, p in captured.root.named_parameters()}
        tied: list[tuple[nn.Parameter, list[int]]] = [
            (params[i], [plan.stage_to_rank[s] for s in ss])
            for i, ss in holders.items()
            if len(ss) > 1 and i in params
        ]
        tied.sort(key=lambda item: names.get(id(item[0]), ""))
        plan = Plan(**{**plan.__dict__, "tied_parameters": tuple(
            (_user_name(names.get(id(p), "?")), tuple(r for r in ranks)) for p, ranks in tied
        )})
        ties = TiedGradients(tied, rank) if tied and plan.world_size > 1 else None
    executor = StageExecutor(stages[my_stage], captured.finish, loss)
    interpreter = Interpreter(rank, {my_stage: executor}, plan.stage_to_rank, wire)
    return Pipeline(captured, stages, plan, rank, executor, interpreter, ties, local, owner_of,
                    output_spec, layer_stage)


def _user_name(name: str) -> str:
    return name.removeprefix("net.")
