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
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradients", "backward_input"]


class WeightGradients:
    """The deferred W of one micro-batch: one `torch.autograd.backward` per group of roots."""

    def __init__(self, calls: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]]):
        self._calls = calls  # (root edges, their gradients, parameters to accumulate)

    def run(self) -> None:
        calls, self._calls = self._calls, []
        for edges, grads, params in calls:
            torch.autograd.backward(edges, grads, inputs=params)


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _graph(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """node -> its children, for every node reachable from `roots`."""
    children: dict[Node, list[Node]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in children:
            children[node] = _children(node)
            stack.extend(children[node])
    return children


def _reach(starts: Any, step: Callable[[Node], Sequence[Node]]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], WeightGradients]:
    """Run B now: return d(outputs)/d(inputs) (zeros where unused) and the W still to run.

    `outputs` are the stage's outputs that carry gradients, `grad_outputs` their gradients
    (None for a scalar loss), `inputs` the received leaves, `params` the stage's parameters.
    """
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs)]
    split = _Split(outputs, grads, inputs, params)
    if not split.separable():  # whole backward now; W does nothing
        torch.autograd.backward(list(outputs), grads)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs], WeightGradients([])
    input_grads, kept = _input_grads_keeping(outputs, grads, inputs, list(split.roots))
    return input_grads, split.weight_gradients(kept)


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


class _Split:
    """One stage's autograd graph seen from its outputs: the nodes on a path to the inputs (D),
    the parameters, the roots of W and their groups (see the module's picture)."""

    def __init__(self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        out_edges = [get_gradient_edge(o) for o in outputs]
        self.children = _graph([e.node for e in out_edges])
        parents: dict[Node, list[Node]] = defaultdict(list)
        for node, kids in self.children.items():
            for kid in kids:
                parents[kid].append(node)
        input_nodes = [n for n in (get_gradient_edge(x).node for x in inputs) if n in self.children]
        self.on_input_path = _reach(input_nodes, lambda n: parents.get(n, []))  # D
        param_of = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
        self.param_of = {n: p for n, p in param_of.items() if n in self.children}
        self._below: dict[Node, frozenset[Node]] = {}  # weight-only node -> parameter nodes below it
        self.roots = self._roots()
        self.output_roots = [  # outputs that do not depend on the inputs: W runs them whole
            (edge, grad) for edge, grad in zip(out_edges, grads)
            if edge.node not in self.on_input_path and self.params_below(edge.node)
        ]
        self._group_of: dict[Node, Node] = {}
        for reached in list(self.roots.values()) + [self.params_below(e.node) for e, _ in self.output_roots]:
            first = next(iter(reached))
            for p in reached:
                self._group_of[self.find(p)] = self.find(first)

    def params_below(self, node: Node) -> frozenset[Node]:
        if node not in self._below:
            found = {node} if node in self.param_of else set()
            for kid in _children(node):  # no descendant of a weight-only node is in D
                found |= self.params_below(kid)
            self._below[node] = frozenset(found)
        return self._below[node]

    def _roots(self) -> dict[Node, frozenset[Node]]:
        """D nodes with a weight-only child, and the parameters each reaches through them."""
        roots: dict[Node, frozenset[Node]] = {}
        for node in self.on_input_path:
            reached: frozenset[Node] = frozenset()
            for kid in self.children[node]:
                if kid not in self.on_input_path:
                    reached |= self.params_below(kid)
            if reached:
                roots[node] = reached
        return roots

    def find(self, n: Node) -> Node:
        """The group of a parameter node (union-find: roots sharing a parameter are one W call)."""
        while self._group_of.setdefault(n, n) is not n:
            n = self._group_of[n]
        return n

    def separable(self) -> bool:
        """Whether no group's W would walk back into D (else a gradient would count twice)."""
        for node, reached in self.roots.items():
            in_d = self.on_input_path
            strictly_below = _reach([k for k in self.children[node] if k in in_d],
                                    lambda n: [k for k in self.children[n] if k in in_d])
            group = self.find(next(iter(reached)))
            for d in strictly_below:
                kids_params = set().union(*(self.params_below(k) for k in self.children[d] if k not in in_d))
                if any(self.find(p) is group for p in kids_params):
                    return False
        return True

    def weight_gradients(self, kept: dict[Node, tuple[Any, ...]]) -> WeightGradients:
        """W: one backward call per group, from its roots' kept gradients and its whole outputs."""
        calls: dict[Node, tuple[list[GradientEdge], list[torch.Tensor], set[Node]]] = {}
        for node, reached in self.roots.items():
            edges, gs, ps = calls.setdefault(self.find(next(iter(reached))), ([], [], set()))
            for i, g in enumerate(kept.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    gs.append(g)
            ps |= reached
        for edge, grad in self.output_roots:
            edges, gs, ps = calls.setdefault(self.find(next(iter(self.params_below(edge.node)))), ([], [], set()))
            edges.append(edge)
            gs.append(grad)
            ps |= self.params_below(edge.node)
        return WeightGradients([
            (edges, gs, [self.param_of[p] for p in ps]) for edges, gs, ps in calls.values() if edges
        ])
