"""The backward split in two: B (the input gradient, now) and W (the weight gradient, later).

B captures the gradient where each parameter's path leaves the input path, so W starts there and
no part of the backward runs twice (docs/engine-internals.md#the-split-backward).

Example::

    >>> layer = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = layer(x)
    >>> (dx,), weight = backward_input([y], [torch.ones_like(y)], [x], layer.parameters())
    >>> layer.weight.grad is None   # B left the parameters alone ...
    True
    >>> weight.run(); layer.weight.grad.shape    # ... W accumulates them, then frees the graph
    torch.Size([4, 4])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass(eq=False)  # groups are compared by identity
class _Group:
    params: list[torch.Tensor]
    exits: set[Node] = field(default_factory=set)
    seeds: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)


class WeightGradient:
    """The W half of a split backward: call :meth:`run` once; it accumulates into ``p.grad``."""

    def __init__(self, groups: list[_Group], captured: dict[Node, tuple[Any, ...]]) -> None:
        self._groups = groups
        self._captured = captured

    def run(self) -> None:
        for group in self._groups:
            _run_group(group, self._captured)
        # Dropping the nodes and gradients releases the retained graph.
        self._groups, self._captured = [], {}


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[Any],
    params: Iterable[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradient]:
    """B: gradients of ``inputs`` (None where an input needs none), and the pending W.

    ``outputs`` must require grad; a None in ``grads`` stands for a scalar loss (gradient 1).
    """
    seeds = [torch.ones_like(y) if g is None else g for y, g in zip(outputs, grads)]
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    roots = [get_gradient_edge(y) for y in outputs]
    parents = _parents([e.node for e in roots])
    input_path = _ancestors({get_gradient_edge(inputs[i]).node for i in wanted}, parents)
    groups = _groups(params, roots, seeds, parents, input_path)
    captured: dict[Node, tuple[Any, ...]] = {}
    handles = [node.register_prehook(_capture(captured, node)) for g in groups for node in g.exits]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    try:
        if wanted:
            found = torch.autograd.grad(
                list(outputs),
                [inputs[i] for i in wanted],
                seeds,
                retain_graph=True,  # W walks the parameter side of the same graph later
                allow_unused=True,
            )
            for i, g in zip(wanted, found):
                result[i] = g
    finally:
        for h in handles:
            h.remove()
    return tuple(result), WeightGradient(groups, captured)


def _capture(captured: dict[Node, tuple[Any, ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[Any, ...]) -> None:
        captured[node] = tuple(grad_outputs)

    return hook


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, with the nodes that feed it gradient."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    stack = list(parents)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(nodes: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node above them: the nodes from which one of ``nodes`` is reached."""
    seen = {n for n in nodes if n in parents}
    stack = list(seen)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _groups(
    params: Iterable[torch.Tensor],
    roots: list[GradientEdge],
    grads: Sequence[torch.Tensor],
    parents: dict[Node, list[Node]],
    input_path: set[Node],
) -> list[_Group]:
    """One group per set of parameters that share an exit (or a seeded output)."""
    root_seeds: dict[Node, list[tuple[GradientEdge, torch.Tensor]]] = {}
    for edge, g in zip(roots, grads):
        if edge.node not in input_path:
            root_seeds.setdefault(edge.node, []).append((edge, g))
    merged: dict[Node, _Group] = {}  # exit or seeded root -> its group
    groups: list[_Group] = []
    for p in params:
        node = get_gradient_edge(p).node if p.requires_grad else None
        if node is None or node not in parents:
            continue  # unused by this stage: no gradient, as in a plain backward
        exits, seeded = _exits(node, parents, input_path, root_seeds)
        group = _Group([p], exits, [s for r in seeded for s in root_seeds[r]])
        for key in exits | seeded:
            other = merged.get(key)
            if other is not None and other is not group:
                group = _merge(other, group, groups)
        for key in group.exits | {s[0].node for s in group.seeds}:
            merged[key] = group
        if group not in groups:
            groups.append(group)
    return groups


def _exits(
    node: Node,
    parents: dict[Node, list[Node]],
    input_path: set[Node],
    root_seeds: dict[Node, list[tuple[GradientEdge, torch.Tensor]]],
) -> tuple[set[Node], set[Node]]:
    """Walks up from a parameter through nodes off the input path; returns the nodes of the
    input path it meets (exits) and the seeded outputs it reaches."""
    exits: set[Node] = set()
    seeded: set[Node] = set()
    seen, stack = {node}, [node]
    while stack:
        n = stack.pop()
        if n in root_seeds:
            seeded.add(n)
        for parent in parents[n]:
            if parent in input_path:
                exits.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return exits, seeded


def _merge(keep: _Group, other: _Group, groups: list[_Group]) -> _Group:
    keep.params += [p for p in other.params if all(p is not q for q in keep.params)]
    keep.exits |= other.exits
    known = {id(e) for e, _ in keep.seeds}
    keep.seeds += [s for s in other.seeds if id(s[0]) not in known]
    if other in groups:
        groups.remove(other)
    return keep


def _run_group(group: _Group, captured: dict[Node, tuple[Any, ...]]) -> None:
    edges: list[GradientEdge] = []
    seeds: list[torch.Tensor] = []
    for node in group.exits:
        for i, g in enumerate(captured.get(node, ())):
            if g is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(g)
    for edge, g in group.seeds:
        edges.append(edge)
        seeds.append(g)
    if not edges:
        return
    pins = []
    if len(group.exits) > 1:  # an exit reached from another exit keeps its captured gradient
        pins = [n.register_prehook(_pin(captured.get(n))) for n in group.exits]
    try:
        found = torch.autograd.grad(
            edges, group.params, seeds, retain_graph=True, allow_unused=True
        )
    finally:
        for h in pins:
            h.remove()
    with torch.no_grad():
        for p, g in zip(group.params, found):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
                _post_accumulate(p)


def _post_accumulate(param: torch.Tensor) -> None:
    """Runs ``param``'s post-accumulate-grad hooks, as autograd does after it accumulates into
    ``.grad``: W accumulates by hand, and a hook a caller registered (an optimizer in the
    backward, a gradient hook) must still see each accumulation. torch keeps them in a private
    dict, in order."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in list((hooks or {}).values()):
        hook(param)


def _pin(grads: tuple[Any, ...] | None) -> Any:
    def hook(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return grads if grads is not None else grad_outputs

    return hook
