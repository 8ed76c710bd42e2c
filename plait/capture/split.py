"""Cutting a captured graph into one fx module per pipeline stage.

Stage s runs the operations of its layers. Whatever a later stage needs from an earlier one
crosses every boundary between them (a skip over two cuts is forwarded through the middle
stage untouched), so each boundary b carries an ordered list of values `boundaries[b]`::

    stage 0            stage 1                stage 2
    x -> a ---------> [a] -> b -----------> [a, b] -> out
         boundary 0: (a)     boundary 1: (a, b)

Model inputs, parameters and input sizes are *local*: every stage that uses one makes it itself
(each rank has the batch), so attention masks and tied weights never cross the wire.
A stage module is called as `module(*received_values, *model_inputs_used)` and returns the tuple
it sends on (or, on the last stage, the model's output).

A graph captured once more in eval mode may read a tensor on another stage than the training
graph did: Mamba's mixer reads `D` and `dt_proj.bias` where its training-only fused call takes
them (after `in_proj`), and in eval mode only in the scan (after `x_proj`). Its training stage is
the only one that holds it up to date (the others have freed it), so `split(..., held_by=...)`
reads such a tensor on the stage that holds it and sends it on like a value::

    training:        stage 0 [in_proj, D] -- D --> stage 1 [x_proj, scan(D)]
    eval, by layer:  stage 0 [in_proj] ----------> stage 1 [x_proj, D, scan(D)]   (freed on 1)
    eval, held_by:   stage 0 [in_proj, D] -- D --> stage 1 [x_proj, scan(D)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from plait.capture.mutation import written_placeholders
from plait.capture.trace import CapturedGraph, is_local
from plait.errors import ConfigError, PartitionError

__all__ = ["LAYER", "StageModule", "split", "stage_of_layers", "stage_holders", "tied_parameters", "tied_named"]

LAYER = "plait_layer"  # a stage graph node's meta key: the captured layer it belongs to


@dataclass
class StageModule:
    """The code one pipeline stage runs, and what it receives and sends."""

    stage_index: int
    module: fx.GraphModule
    recv_names: list[str]  # values received from the previous stage, in call order
    send_names: list[str]  # values sent to the next stage (empty on the last stage)
    input_indices: list[int]  # which placeholders (model inputs) the stage takes, after recv
    is_last: bool
    written_recv: tuple[int, ...] = ()  # received values the stage writes in place (capture/mutation)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this stage uses (shared with the user's model)."""
        return list(self.module.parameters())


def stage_of_layers(layers_per_stage: Sequence[int]) -> list[int]:
    """[2, 3] -> [0, 0, 1, 1, 1]."""
    return [s for s, n in enumerate(layers_per_stage) for _ in range(n)]


def split(captured: CapturedGraph, layer_stage: Sequence[int],
          held_by: Mapping[int, Sequence[int]] | None = None) -> list[StageModule]:
    """Build the stage modules given the stage of every layer (non-decreasing).

    `held_by`: id(tensor) -> the stages that hold it (another split's, the training graph's); a
    tensor read on a stage that does not hold it is read on the last holding stage before and
    sent on (see above)."""
    num_chunks = max(layer_stage) + 1
    if any(b < a for a, b in zip(layer_stage, layer_stage[1:])):
        raise PartitionError(f"stages of layers must not decrease, got {list(layer_stage)}")
    layer_of = dict(zip(captured.ops, captured.layers.op_layer))
    node_stage: dict[fx.Node, int] = {op: layer_stage[layer] for op, layer in layer_of.items()}
    read_on = _read_on_holders(captured, node_stage, held_by or {})
    node_stage.update(read_on)
    order = {n: i for i, n in enumerate(captured.graph.nodes)}
    output = next(n for n in captured.graph.nodes if n.op == "output")
    last = num_chunks - 1

    # needed[s]: non-local values stage s uses that an earlier stage makes.
    crossing: set[fx.Node] = set()
    first_use: dict[fx.Node, int] = {}
    last_use: dict[fx.Node, int] = {}
    for node in list(node_stage) + [output]:
        s = node_stage.get(node, last)
        for src in node.all_input_nodes:
            if is_local(src) and src not in read_on:
                continue
            if node_stage[src] > s:
                raise PartitionError(f"{node.name} on stage {s} uses {src.name} from a later stage")
            if node_stage[src] < s:
                crossing.add(src)
                last_use[src] = max(last_use.get(src, s), s)
                first_use[src] = min(first_use.get(src, s), s)
    boundaries: list[list[fx.Node]] = []
    for b in range(num_chunks - 1):
        carried = [n for n in crossing if node_stage[n] <= b < last_use[n]]
        boundaries.append(sorted(carried, key=order.__getitem__))

    placeholders = [n for n in captured.graph.nodes if n.op == "placeholder"]
    stages = []
    for s in range(num_chunks):
        recv = boundaries[s - 1] if s > 0 else []
        send = boundaries[s] if s < last else []
        ops = [n for n in read_on if read_on[n] == s] + [n for n in captured.ops if node_stage[n] == s]
        module, input_indices = _build(captured, s, recv, send, ops, output if s == last else None,
                                       placeholders, layer_of)
        written = written_placeholders(module.graph, module)
        placeholders_of_recv = [n for n in module.graph.nodes if n.op == "placeholder"][:len(recv)]
        stages.append(
            StageModule(s, module, [n.name for n in recv], [n.name for n in send], input_indices,
                        s == last, tuple(i for i, n in enumerate(placeholders_of_recv) if n in written))
        )
    return stages


def _build(
    captured: CapturedGraph,
    stage_index: int,
    recv: list[fx.Node],
    send: list[fx.Node],
    ops: list[fx.Node],
    output: fx.Node | None,
    placeholders: list[fx.Node],
    layer_of: dict[fx.Node, int],
) -> tuple[fx.GraphModule, list[int]]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in recv:
        env[node] = graph.placeholder(f"recv_{node.name}")
        if "val" in node.meta:  # the traced value, for what reads shapes (the tp layout)
            env[node].meta["val"] = node.meta["val"]
    # Which model inputs does this stage touch (directly or through a local size op)?
    used: set[fx.Node] = set()

    def visit(src: fx.Node) -> None:
        if src.op == "placeholder":
            used.add(src)
        elif is_local(src):
            for x in src.all_input_nodes:
                visit(x)

    for node in ops + ([output] if output is not None else []):
        for src in node.all_input_nodes:
            visit(src)
    input_indices = [i for i, p in enumerate(placeholders) if p in used]
    for i in input_indices:
        env[placeholders[i]] = graph.placeholder(f"input_{placeholders[i].name}")
        if "val" in placeholders[i].meta:
            env[placeholders[i]].meta["val"] = placeholders[i].meta["val"]

    def lookup(src: fx.Node) -> fx.Node:
        if src not in env:  # a local node used for the first time on this stage
            env[src] = graph.node_copy(src, lookup)
        return env[src]

    for node in ops:
        if node not in env:
            env[node] = graph.node_copy(node, lookup)
        if node in layer_of:  # not a tensor read for the stages after (`read_on`)
            env[node].meta[LAYER] = layer_of[node]  # for recomputation layer by layer
    if output is not None:
        graph.output(fx.map_arg(output.args[0], lookup))
    else:
        graph.output(tuple(lookup(n) for n in send))
    graph.lint()
    module = fx.GraphModule(captured.root, graph, class_name=f"Stage{stage_index}")
    return module, input_indices


def _read_on_holders(captured: CapturedGraph, node_stage: Mapping[fx.Node, int],
                     held_by: Mapping[int, Sequence[int]]) -> dict[fx.Node, int]:
    """The tensor reads (get_attr) to make on a holding stage and send on: stage of each.

    A read used on a stage that does not hold its tensor moves to the last holder before its
    first use; with no holder before it, the tensor cannot reach it (values only flow forward)."""
    out: dict[fx.Node, int] = {}
    if not held_by:
        return out
    for node in captured.graph.nodes:
        if node.op != "get_attr":
            continue
        holders = held_by.get(id(_attribute(captured.root, str(node.target))), ())
        used = sorted({node_stage[u] for u in node.users if u in node_stage})
        if not holders or not used or set(used) <= set(holders):
            continue
        before = [h for h in holders if h <= used[0]]
        if not before:
            raise PartitionError(
                f"{node.target} is read on stage {used[0]} in this graph, before stage {min(holders)} that "
                f"holds it in the training graph (stages {sorted(holders)}), and values only flow forward: "
                "cut elsewhere (Config(layers_per_stage=...)), so the layers that read it share a stage")
        out[node] = max(before)
    return out


def _attribute(root: nn.Module, target: str) -> torch.Tensor | None:
    """The tensor a get_attr target names in `root` (None if it is not a tensor)."""
    value: object = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def stage_holders(stages: Sequence[StageModule]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Which stages hold each parameter/buffer (by id; more than one: a tied, reused tensor), and the tensors."""
    holders: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for st in stages:
        for t in list(st.module.parameters()) + list(st.module.buffers()):
            if st.stage_index not in holders.setdefault(id(t), []):
                holders[id(t)].append(st.stage_index)
            tensors[id(t)] = t
    return holders, tensors


def tied_parameters(stages: Sequence[StageModule], root: nn.Module) -> list[tuple[str, nn.Parameter, tuple[int, ...]]]:
    """The parameters more than one stage holds (a reused layer, weights tied across stages): (the
    user's name, the parameter, its stages), in name order."""
    holders, tensors = stage_holders(stages)
    names = {id(p): n for n, p in root.named_parameters()}
    tied = [(names.get(i, ""), t, tuple(ss)) for i, ss in holders.items()
            if len(ss) > 1 and isinstance(t := tensors[i], nn.Parameter)]
    return [((name or "?").removeprefix("net."), p, ss) for name, p, ss in sorted(tied, key=lambda item: item[0])]


def tied_named(root: nn.Module, tied: Sequence[tuple[str, tuple[int, ...]]]) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    """The parameters a plan names as tied (`tied_parameters`' names and stages), looked up in `root`."""
    params = {n.removeprefix("net."): p for n, p in root.named_parameters()}
    missing = [name for name, _ in tied if name not in params]
    if missing:
        raise ConfigError(f"the plan ties parameters {missing} that the model does not have; the plan was made "
                          "for another model: plan again")
    return [(params[name], tuple(stages)) for name, stages in tied]
