"""Cutting: the captured graph into pieces, one ``torch.fx.GraphModule`` per child of the
Sequential, and what crosses each cut (a parameter used on both sides: shared, carried along or
refused, as ``tied`` says).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from giantpipe.engine.capture.cuts import _paths
from giantpipe.engine.capture.graph import CaptureError, _Graph, _lookup, aten

__all__ = ["device_of"]


def _partition(graph: _Graph, cuts: list[int], tied: str) -> tuple[list[fx.GraphModule], list]:
    """The pieces, and for each cut the values that cross it (in graph order)."""
    nodes = graph.nodes()
    bounds = [0, *cuts, len(nodes)]
    last = len(bounds) - 2
    home: dict[fx.Node, int] = {n: 0 for n in graph.inputs}
    for p in range(last + 1):
        home.update((n, p) for n in nodes[bounds[p] : bounds[p + 1]])
    reach = _last_uses(graph, home, last)
    shared: dict[fx.Node, list[int]] = {}  # tied="share": held by each piece using it
    for attr, (fqn, obj) in graph.attrs.items():
        users = sorted({home[u] for u in attr.users if u in home})
        if users:
            home[attr] = users[0]
            if len(users) > 1 and isinstance(obj, nn.Parameter) and tied != "carry":
                if tied == "error":
                    raise CaptureError(_tied_message(fqn, attr, home, users), "tied")
                shared[attr] = users
                home[attr] = users[-1]  # never crosses a cut: every user holds it
    order = [n for n in graph.graph.nodes if n in home and n in reach]
    carried = [[v for v in order if home[v] < b <= reach[v]] for b in range(1, last + 1)]
    ins = [list(graph.inputs), *carried]
    outs = [*carried, graph.output_values()]
    pieces = [
        _Piece(graph, home, p, shared).build(nodes[bounds[p] : bounds[p + 1]], ins[p], outs[p])
        for p in range(last + 1)
    ]
    _attach_unused(pieces[0], graph.model, pieces)
    return pieces, carried


def _last_uses(graph: _Graph, home: dict[fx.Node, int], last: int) -> dict[fx.Node, int]:
    """The last piece that needs each value (the output counts as the last piece)."""
    reach: dict[fx.Node, int] = {}
    for node in graph.graph.nodes:
        for source in node.all_input_nodes:
            where = last if node.op == "output" else home.get(node, 0)
            reach[source] = max(reach.get(source, 0), where)
    return reach


def _tied_message(fqn: str, attr: fx.Node, home: dict[fx.Node, int], pieces: list[int]) -> str:
    users = sorted({p for u in attr.users for p in _paths(u) if u in home}, key=len)
    return (
        f"sequentialize: parameter `{fqn}` is used on both sides of a cut (pieces {pieces}, "
        f"by {users[-2:] if users else '?'}); pass tied='share' (the engine keeps the "
        "stages' copies tied) or tied='carry', untie it (e.g. "
        "config.tie_word_embeddings=False), or choose split points that keep its uses together"
    )


def device_of(tensor: torch.Tensor) -> torch.device:
    """The device a piece runs on: its first input's (what export fixed as the trace device)."""
    return tensor.device


class _Piece:
    """Builds one piece: a GraphModule taking one argument (a tensor or a tuple of values)."""

    def __init__(
        self, graph: _Graph, home: dict[fx.Node, int], index: int, shared: Mapping[fx.Node, Any]
    ) -> None:
        self.source, self.home, self.index, self.shared = graph, home, index, shared
        self.graph = fx.Graph()
        self.root = nn.Module()  # what the piece's get_attr / call_module targets name
        self.env: dict[fx.Node, fx.Node] = {}

    def build(self, nodes: list[fx.Node], ins: list[fx.Node], outs: list[Any]) -> fx.GraphModule:
        arg = self.graph.placeholder("inputs")
        for j, value in enumerate(ins):
            single = len(ins) == 1
            self.env[value] = (
                arg if single else self.graph.call_function(operator.getitem, (arg, j))
            )
        anchor = next((self.env[v] for v in ins if _is_tensor(v)), None)
        device = None
        if anchor is not None and any(_has_device(n) for n in nodes):
            device = self.graph.call_function(device_of, (anchor,))
        for node in nodes:
            self.env[node] = self.graph.node_copy(node, self.value)
            self._install(node)
            if device is not None:
                _retarget(self.env[node], device)
        results = [self._result(v, ins) for v in outs]
        self.graph.output(results[0] if len(results) == 1 else tuple(results))
        piece = fx.GraphModule(self.root, self.graph)
        return piece

    def value(self, node: fx.Node) -> fx.Node:
        """A node of this piece for a value of the captured graph."""
        if node in self.env:
            return self.env[node]
        held = self.home.get(node) == self.index or self.index in self.shared.get(node, ())
        if node in self.source.attrs and held:
            fqn, obj = self.source.attrs[node]
            _assign(self.root, fqn, obj, _persistent(self.source.model, fqn))
        elif node in self.source.constants:
            fqn = f"_constant_{node.name}"
            self.root.register_buffer(fqn, self.source.constants[node], persistent=False)
        else:
            raise CaptureError(
                f"sequentialize: value {node.name} is not available in piece {self.index}"
            )
        self.env[node] = self.graph.get_attr(fqn)
        self.env[node].meta = dict(node.meta)
        return self.env[node]

    def _install(self, node: fx.Node) -> None:
        if node.op == "call_module":
            _assign(self.root, str(node.target), self.source.layers[str(node.target)], True)
        elif node.op == "get_attr":  # a higher-order op's body (a graph module of its own)
            _assign(self.root, str(node.target), _lookup(self.source.owner, str(node.target)), True)

    def _result(self, value: Any, ins: list[fx.Node]) -> Any:
        if not isinstance(value, fx.Node):
            return value
        node = self.value(value)
        # A float value handed on untouched (a carried parameter, a skipped hidden state) gets
        # a node of its own, so each stage's output has a grad_fn of its own.
        if (value in ins or value in self.source.attrs) and _is_float(value):
            node = self.graph.call_function(aten.alias.default, (node,))
        return node


def _is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _is_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _has_device(node: fx.Node) -> bool:
    found: list[bool] = []
    fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: found.append(isinstance(a, torch.device))
    )
    return any(found)


def _retarget(node: fx.Node, device: fx.Node) -> None:
    """Ops that create tensors on the trace device create them where the piece runs."""

    def swap(a: Any) -> Any:
        return device if isinstance(a, torch.device) else a

    node.args = fx.node.map_aggregate(node.args, swap)
    node.kwargs = fx.node.map_aggregate(node.kwargs, swap)


def _persistent(model: nn.Module, fqn: str) -> bool:
    path, _, name = fqn.rpartition(".")
    owner = model.get_submodule(path) if path else model
    return name not in owner._non_persistent_buffers_set  # noqa: SLF001


def _assign(root: nn.Module, fqn: str, obj: Any, persistent: bool) -> None:
    """Sets ``root.<fqn>`` to ``obj``, making the intermediate modules (names kept)."""
    *path, name = fqn.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    if isinstance(obj, nn.Parameter):
        root.register_parameter(name, obj)
    elif isinstance(obj, torch.Tensor):
        root.register_buffer(name, obj, persistent=persistent)
    elif isinstance(obj, nn.Module):
        root.add_module(name, obj)
    else:
        setattr(root, name, obj)


def _attach_unused(first: nn.Module, model: nn.Module, pieces: list[fx.GraphModule]) -> None:
    """State forward never touches still belongs to the model (and to its checkpoints)."""
    held = {id(t) for p in pieces for t in p.state_dict(keep_vars=True).values()}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in held:
            _assign(first, name, tensor, True)
            held.add(id(tensor))
