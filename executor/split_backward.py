"""A backward split in two at the level of autograd's operations: input, then weights.

Zero-bubble schedules run a stage's backward as ``I`` (the gradient of its input: what
the previous stage waits for) and later ``W`` (its weight gradients).  Cutting between
*layers* would not do: reaching the first linear map of a transformer block from the
block's output means back-propagating through the whole block.  The cut is made in the
autograd graph instead:

    y.grad_fn ... J ----------> ... x          nodes that reach the input x: run in I
                  \\
                   `--> T --> AccumulateGrad(w)   nodes that reach only weights: W

A *join* J is a node that reaches the input and also has a child reaching weights but
not the input (``AddmmBackward`` of ``x @ w.T + b``: its mat1 gradient is I's, its mat2
and bias gradients W's).  ``I`` is one ``autograd.grad`` to the input and to every
join's incoming gradients (``GradientEdge``), keeping the graph: the engine runs each
join only for its input-side outputs.  ``W`` then runs, join by join, from those
gradients to that join's weights alone: the engine runs the join again for its
weight-side outputs only.  A graph root that does not reach the input (a first stage,
whose input is data) is a join whose whole backward is W.

Weights reached from two joins (shared weights) could be reached by one join's W
through another join, counting a gradient twice: then ``I`` forms every gradient itself
(a full backward) and ``W`` has nothing left to do -- always correct, never split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _accumulator(t: torch.Tensor) -> Node:
    """The AccumulateGrad node of leaf ``t`` (the one its graph uses)."""
    grad_fn = t.view_as(t).grad_fn
    assert grad_fn is not None
    node = grad_fn.next_functions[0][0]
    assert node is not None
    return node


def _children(node: Node) -> list[Node]:
    return [c for c, _ in node.next_functions if c is not None]


@dataclass
class WeightWork:
    """What ``I`` leaves for ``W``: each join, its weights and its incoming gradients."""

    joins: list[tuple[Node, list[torch.Tensor], list[torch.Tensor | None]]] = field(
        default_factory=list)

    def clear(self) -> None:
        self.joins = []

    def held(self) -> list[torch.Tensor]:
        """The gradients kept for W, one tensor per storage."""
        seen: dict[int, torch.Tensor] = {}
        for _, _, grads in self.joins:
            for g in grads:
                if g is not None:
                    seen.setdefault(g.untyped_storage().data_ptr(), g)
        return list(seen.values())


def _joins(root: Node, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
           ) -> list[tuple[Node, list[torch.Tensor]]] | None:
    """Join nodes below ``root`` and each one's weights; None when weights are shared."""
    accs = {_accumulator(p): p for p in params}
    input_accs = {_accumulator(x) for x in inputs}
    reaches_input: dict[Node, bool] = {}
    reaches_param: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    seen: set[Node] = set()
    while stack:  # iterative post-order: the graph can be deeper than Python's stack
        node, expanded = stack.pop()
        if expanded:
            kids = _children(node)
            reaches_input[node] = node in input_accs or any(reaches_input[c] for c in kids)
            reaches_param[node] = node in accs or any(reaches_param[c] for c in kids)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack += [(c, False) for c in _children(node) if c not in seen]
    joins = []
    owner: dict[Node, Node] = {}
    for node in seen:
        if node in accs or node in input_accs:
            continue
        if reaches_input[node]:
            weight_side = [c for c in _children(node) if reaches_param[c] and not reaches_input[c]]
        elif node is root and reaches_param[node]:
            weight_side = [node]
        else:
            continue
        if not weight_side:
            continue
        found: list[torch.Tensor] = []
        todo, visited = list(weight_side), set()
        while todo:
            n = todo.pop()
            if n in visited:
                continue
            visited.add(n)
            if n in accs:
                if owner.setdefault(n, node) is not node:
                    return None  # a weight two joins reach: no safe split
                found.append(accs[n])
            else:
                todo += [c for c in _children(n) if reaches_param[c]]
        joins.append((node, found))
    return joins


def input_grad(y: torch.Tensor, grad: torch.Tensor | None, inputs: Sequence[torch.Tensor],
               params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightWork]:
    """``I``: the gradients of ``inputs`` (leaves that require grad), and what ``W`` needs.

    ``y`` is the stage's output (or its loss, ``grad`` None); the graph is kept for W.
    """
    work = WeightWork()
    if y.grad_fn is None:
        return [None] * len(inputs), work
    joins = _joins(y.grad_fn, inputs, params)
    if joins is None:  # shared weights: the whole backward now, W left with nothing
        wanted = [*inputs, *params]
        got = torch.autograd.grad(y, wanted, grad, allow_unused=True) if wanted else ()
        for p, g in zip(params, got[len(inputs):], strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        return list(got[:len(inputs)]), work
    edges = [[GradientEdge(j, k) for k in range(len(j._input_metadata))] for j, _ in joins]
    wanted_edges = [*map(get_gradient_edge, inputs), *(e for es in edges for e in es)]
    got = (torch.autograd.grad(y, wanted_edges, grad, retain_graph=True, allow_unused=True)
           if wanted_edges else ())
    at = len(inputs)
    for (join, ws), es in zip(joins, edges, strict=True):
        work.joins.append((join, ws, list(got[at:at + len(es)])))
        at += len(es)
    return list(got[:len(inputs)]), work


def weight_grad(work: WeightWork) -> None:
    """``W``: every join's weight gradients, from the gradients ``I`` captured, into
    ``.grad``; then what ``I`` left is dropped."""
    for join, weights, grads in work.joins:
        pairs = [(GradientEdge(join, k), g) for k, g in enumerate(grads) if g is not None]
        if pairs and weights:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs], inputs=weights)
    work.clear()
