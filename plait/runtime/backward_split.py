"""The backward pass cut in two on a stage's own autograd graph: input gradients now (B), weight gradients later (W).

Zero-bubble schedules (Qi et al. 2023) send the gradient of a stage's input upstream as soon as it
is known and compute the weight gradients later, in what would be bubbles. plait does this on the
autograd graph the stage's forward recorded, with no change to the model:

    outputs --> n3 ------> n2 ------> n1 ------> stage input x       D: the nodes on a path to x
                |          |          |                                 (B runs only these)
                v          v          v
              T(W3)      T(W2)      T(W1) --> W1, b1 ...              the rest: weight-only paths
                                                                        (W runs these)

B: `torch.autograd.grad(outputs, x)` executes only the nodes in D, and each computes only the
outputs that lead to x -- an addmm node computes dX but not dW. A pre-hook on every D node with
a weight-only child (n1, n2, n3: the "roots" of W) keeps the gradient flowing into it.
W: `torch.autograd.backward` from each root, with that kept gradient, restricted by `inputs=` to
the parameters below it: the root's node runs again computing only its weight outputs, then the
weight-only paths, and the parameters' `.grad` accumulate (post-accumulate hooks fire, as in an
ordinary backward). Roots that reach a common parameter form one group and one call, so every
parameter is accumulated exactly once per micro-batch.

If some W call would also walk back into D (a parameter reached from a root through another D
node, e.g. a weight used both near the output and near the input of one stage), its gradient
would be counted twice; such a stage runs its whole backward in B and its W does nothing.

Finding D, the roots and their groups is Python work on every node of the graph. A stage records
the same graph at every micro-batch of the same shapes, so the graph is walked into integers (each
node's children by their place in a fixed depth-first order, which nodes are the inputs' and the
parameters') and the analysis done on those integers is kept per walk (`SplitPlans`): a graph whose
walk matches one seen before reuses its analysis, and anything else is analysed anew.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch.autograd import graph as autograd_graph
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradients", "SplitPlans", "backward_input"]

_ACCUMULATE: type = getattr(torch._C._functions, "AccumulateGrad")  # the node of a leaf that requires grad
_PLANS_KEPT = 16  # analyses a stage keeps: one per shape of its graph (micro-batch shapes, train/eval)


class WeightGradients:
    """The deferred W of one micro-batch: one `torch.autograd.backward` per group of roots."""

    def __init__(self, calls: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]]):
        self._calls = calls  # (root edges, their gradients, parameters to accumulate)

    def run(self) -> None:
        calls, self._calls = self._calls, []
        for edges, grads, params in calls:
            _accumulate(edges, grads, params)


_ENGINE = getattr(autograd_graph, "_engine_run_backward", None)


def _accumulate(edges: list[GradientEdge], grads: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """`torch.autograd.backward(edges, grads, inputs=params)`: the parameters' `.grad` accumulate.

    W's gradients are the ones autograd itself kept at B for these very edges, so the checks
    `backward` makes of them first (shapes, dtypes, from each edge's metadata in Python: about
    40 us a call, four calls a micro-batch for four linear layers) are skipped where torch has
    its engine's entry point (`_engine_run_backward`, what `backward` calls after them).
    """
    if _ENGINE is None:
        torch.autograd.backward(edges, grads, inputs=params)
    else:
        _ENGINE(tuple(edges), tuple(grads), False, False, tuple(params), allow_unreachable=True, accumulate_grad=True)


class _Walk:
    """One graph as integers: its nodes in depth-first order from the outputs, each node's children
    by index, the inputs' nodes, the parameters' nodes; `key` is all of it, the analysis's input."""

    def __init__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor]) -> None:
        self.out_edges = [get_gradient_edge(o) for o in outputs]
        index: dict[Node, int] = {}
        nodes: list[Node] = []
        nexts: list[tuple[Any, ...]] = []
        stack = [e.node for e in reversed(self.out_edges)]
        while stack:
            node = stack.pop()
            if node in index:
                continue
            index[node] = len(nodes)
            nodes.append(node)
            nxt = node.next_functions
            nexts.append(nxt)
            stack.extend(child for child, _ in reversed(nxt) if child is not None)
        self.nodes = nodes
        self.children = tuple(tuple(index[c] for c, _ in nxt if c is not None) for nxt in nexts)
        # a leaf's node is its AccumulateGrad, which names it (`variable`): no view per leaf to find it
        leaves = {id(t): t for t in (*inputs, *params) if t.grad_fn is None}
        variable = {id(v): i for i, node in enumerate(nodes) if type(node) is _ACCUMULATE
                    for v in (getattr(node, "variable"),) if id(v) in leaves}

        def place(t: torch.Tensor) -> int | None:
            if t.grad_fn is None:
                return variable.get(id(t))
            return index.get(get_gradient_edge(t).node)

        self.input_nodes = tuple(sorted({i for i in map(place, inputs) if i is not None}))
        self.param_of = tuple((i, j) for j, p in enumerate(params) if p.requires_grad
                              for i in (place(p),) if i is not None)  # (node, parameter position)
        self.output_places = tuple((index[e.node], e.output_nr) for e in self.out_edges)  # (node, its output)
        self.key = (self.children, self.input_nodes, self.param_of, self.output_places)


def _reach(starts: Iterable[int], step: Callable[[int], Iterable[int]]) -> set[int]:
    seen: set[int] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


class _Plan:
    """One graph's split, in the walk's integers: the nodes on a path to the inputs (D), the roots
    of W and their groups (see the module's picture), and whether W can run apart from B."""

    def __init__(self, walk: _Walk) -> None:
        children = walk.children
        parents: list[list[int]] = [[] for _ in children]
        for node, kids in enumerate(children):
            for kid in kids:
                parents[kid].append(node)
        in_d = _reach(walk.input_nodes, parents.__getitem__)  # D
        self._children, self._in_d = children, in_d
        self._param_nodes = {i for i, _ in walk.param_of}
        self._below: dict[int, frozenset[int]] = {}  # weight-only node -> parameter nodes below it
        roots: dict[int, frozenset[int]] = {}  # D nodes with a weight-only child -> the parameters it reaches
        for node in sorted(in_d):
            reached = frozenset().union(*(self._params_below(k) for k in children[node] if k not in in_d))
            if reached:
                roots[node] = reached
        outs = [(j, node) for j, (node, _) in enumerate(walk.output_places)
                if node not in in_d and self._params_below(node)]  # outputs not depending on the inputs: run whole
        self._group_of: dict[int, int] = {}
        for reached in [*roots.values(), *(self._params_below(node) for _, node in outs)]:
            first = min(reached)
            for p in reached:
                self._group_of[self._find(p)] = self._find(first)
        self.separable = self._separable(roots)
        self.roots = tuple(roots)
        position = dict(walk.param_of)
        groups: dict[int, tuple[list[int], list[int], set[int]]] = {}
        for node, reached in roots.items():
            group = groups.setdefault(self._find(min(reached)), ([], [], set()))
            group[0].append(node)
            group[2].update(reached)
        for j, node in outs:
            group = groups.setdefault(self._find(min(self._params_below(node))), ([], [], set()))
            group[1].append(j)
            group[2].update(self._params_below(node))
        # per W call: its root nodes, its whole outputs (by position), its parameters (by position)
        self.calls = tuple((tuple(r), tuple(o), tuple(sorted(position[p] for p in ps))) for r, o, ps in groups.values())

    def _params_below(self, node: int) -> frozenset[int]:
        if node not in self._below:
            found = {node} if node in self._param_nodes else set()
            for kid in self._children[node]:  # no descendant of a weight-only node is in D
                found |= self._params_below(kid)
            self._below[node] = frozenset(found)
        return self._below[node]

    def _find(self, n: int) -> int:
        """The group of a parameter node (union-find: roots sharing a parameter are one W call)."""
        while self._group_of.setdefault(n, n) != n:
            n = self._group_of[n]
        return n

    def _separable(self, roots: dict[int, frozenset[int]]) -> bool:
        """Whether no group's W would walk back into D (else a gradient would count twice)."""
        children, in_d = self._children, self._in_d
        for node, reached in roots.items():
            strictly_below = _reach([k for k in children[node] if k in in_d],
                                    lambda n: [k for k in children[n] if k in in_d])
            group = self._find(min(reached))
            for d in strictly_below:
                for k in children[d]:
                    if k not in in_d and any(self._find(p) == group for p in self._params_below(k)):
                        return False
        return True

    def weight_gradients(self, walk: _Walk, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                         kept: dict[Node, tuple[Any, ...]]) -> WeightGradients:
        """W: one backward call per group, from its roots' kept gradients and its whole outputs."""
        calls = []
        for roots, outs, positions in self.calls:
            edges: list[GradientEdge] = []
            gs: list[torch.Tensor] = []
            for r in roots:
                node = walk.nodes[r]
                for i, g in enumerate(kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        gs.append(g)
            for j in outs:
                edges.append(walk.out_edges[j])
                gs.append(grads[j])
            if edges:
                calls.append((edges, gs, [params[p] for p in positions]))
        return WeightGradients(calls)


class SplitPlans:
    """A stage's analyses by the walk of its graph (see the module): the same graph, analysed once."""

    def __init__(self) -> None:
        self._plans: dict[Any, _Plan] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, walk: _Walk) -> _Plan:
        found = self._plans.get(walk.key)
        if found is None:
            if len(self._plans) >= _PLANS_KEPT:  # a stage whose graph keeps changing: start again
                self._plans.clear()
            found = self._plans[walk.key] = _Plan(walk)
        return found


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    plans: SplitPlans | None = None,
) -> tuple[list[torch.Tensor], WeightGradients]:
    """Run B now: return d(outputs)/d(inputs) (zeros where unused) and the W still to run.

    `outputs` are the stage's outputs that carry gradients, `grad_outputs` their gradients
    (None for a scalar loss), `inputs` the received leaves, `params` the stage's parameters;
    `plans`, the stage's analyses kept from its earlier micro-batches.
    """
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs)]
    if not inputs:  # no input gradient to send (the first stage): W is the whole backward, in one call
        weights = [p for p in params if p.requires_grad]
        return [], WeightGradients([([get_gradient_edge(o) for o in outputs], grads, weights)] if weights else [])
    walk = _Walk(outputs, inputs, params)
    split = plans.plan(walk) if plans is not None else _Plan(walk)
    if not split.separable:  # whole backward now; W does nothing
        torch.autograd.backward(list(outputs), grads)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs], WeightGradients([])
    input_grads, kept = _input_grads_keeping(outputs, grads, inputs, [walk.nodes[r] for r in split.roots])
    return input_grads, split.weight_gradients(walk, grads, params, kept)


def _input_grads_keeping(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         inputs: Sequence[torch.Tensor],
                         roots: Sequence[Node]) -> tuple[list[torch.Tensor], dict[Node, tuple[Any, ...]]]:
    """B: the gradients of `inputs` (zeros where unused), keeping the gradient flowing into each root."""
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [node.register_prehook(lambda g, node=node: kept.__setitem__(node, g)) for node in roots]
    try:
        if not inputs:
            return [], kept
        found = torch.autograd.grad(list(outputs), list(inputs), list(grads), retain_graph=True,
                                    allow_unused=True)
        return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)], kept
    finally:
        for handle in handles:
            handle.remove()
