"""Where to cut a captured graph: the split points given, or every repeated block (transformer
layers, residual blocks) and the head after the last one.

Example::

    >>> from torch import nn
    >>> model = nn.Module()
    >>> model.blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    >>> repeated_blocks(model)
    [['blocks.0', 'blocks.1', 'blocks.2']]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import fx, nn

from giantpipe.engine.capture.graph import CaptureError, _Graph

__all__ = ["repeated_blocks"]


def repeated_blocks(model: nn.Module) -> list[list[str]]:
    """Groups of repeated blocks: the children of a ModuleList / Sequential (or a subclass) that
    share a class (transformer layers, residual blocks), outermost first. A container of plain
    containers (stages of blocks) is looked into; a block's insides are not blocks; groups of
    composite blocks win over groups of single layers (MobileNet's inverted residuals over its
    classifier's two Linear layers).

    >>> from torch import nn
    >>> model = nn.Module()
    >>> model.embed, model.head = nn.Embedding(10, 8), nn.Linear(8, 10)
    >>> model.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    >>> repeated_blocks(model)
    [['layers.0', 'layers.1', 'layers.2']]

    A torchvision ResNet-18 gives ``[['layer1.0', 'layer1.1'], ['layer2.0', 'layer2.1'], ...]``,
    a MobileNetV3-small ``[['features.0', 'features.1', 'features.2', ...], ...]``.
    """
    groups: list[list[str]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or _inside(name, taken):
            continue
        children = [(f"{name}.{c}" if name else c, m) for c, m in module.named_children()]
        kinds = [type(m) for _, m in children]
        # plain containers as children: stages of blocks (EfficientNet's, Swin's), looked into
        if len(children) < 2 or any(k in (nn.ModuleList, nn.Sequential) for k in kinds):
            continue
        if any(kinds.count(k) > 1 for k in kinds):
            groups.append([c for c, _ in children])
            taken.append(name)
    block_kinds = {type(model.get_submodule(c)) for group in groups for c in group}
    groups = [g for g in groups if not _within_kind(model, g[0], block_kinds)]
    composite = [g for g in groups if any(_has_children(model.get_submodule(c)) for c in g)]
    return composite or groups


def _within_kind(model: nn.Module, name: str, kinds: set[type]) -> bool:
    """Some module above ``name`` (not the root) is of one of ``kinds``."""
    parts = name.split(".")
    above = (".".join(parts[:i]) for i in range(1, len(parts) - 1))
    return any(type(model.get_submodule(path)) in kinds for path in above)


def _has_children(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _inside(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _paths(node: fx.Node) -> set[str]:
    return {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()}


def _cut_positions(
    graph: _Graph, model: nn.Module, split_points: Sequence[str] | None
) -> list[int]:
    """Positions in ``graph.nodes()`` where a piece starts: the first node of each split point's
    module call (and, for the repeated blocks, the first node after the last block)."""
    nodes = graph.nodes()
    paths = [_paths(n) for n in nodes]
    cuts: set[int] = set()
    groups = [list(split_points)] if split_points is not None else repeated_blocks(model)
    for group in groups:
        for name in group:
            hits = [i for i, p in enumerate(paths) if name in p]
            if not hits:
                raise CaptureError(
                    f"sequentialize: split point `{name}` is a submodule, but forward never "
                    "calls it on these inputs; pick a submodule that runs",
                    "split_points",
                )
            cuts.add(hits[0])
            if split_points is None and name == group[-1]:
                cuts.add(hits[-1] + 1)  # the head after the last block is a piece of its own
    return sorted(c for c in cuts if 0 < c < len(nodes))


def _spans(nodes: list[fx.Node], cuts: list[int]) -> list[frozenset[str]]:
    """Per piece, the submodule names whose calls its nodes belong to (from export's module
    stacks; the cuts' positions as :func:`_cut_positions` gives them)."""
    bounds = [0, *cuts, len(nodes)]
    return [
        frozenset(path for n in nodes[a:b] for path in _paths(n))
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def _check_split_point(model: nn.Module, name: str) -> None:
    try:
        model.get_submodule(name)
    except AttributeError:
        parent = name.rpartition(".")[0]
        try:
            siblings = [f"{parent}.{c}" if parent else c for c, _ in _children(model, parent)]
        except AttributeError:
            siblings = [c for c, _ in model.named_children()]
        raise CaptureError(
            f"sequentialize: split point `{name}` is not a submodule of "
            f"{type(model).__name__}; pick another split point, e.g. one of "
            f"{siblings[:8]} (model.named_modules() lists them)",
            "split_points",
        ) from None


def _children(model: nn.Module, path: str) -> Iterable[tuple[str, nn.Module]]:
    return (model.get_submodule(path) if path else model).named_children()
