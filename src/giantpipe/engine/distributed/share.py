"""A rank's share of a model built on meta: its stages, and with R > 1 replicas its FSDP2 shards.

The rank cuts the model by the balance and keeps its own stages (every other stage is an
:class:`Absent` placeholder); their layers are made real on its device (R = 1,
:func:`giantpipe.engine.meta.materialize`), or, spread over the replicas, only this rank's
shard of each parameter is (:func:`fill_shards`): each layer is made whole on the host from a
meta copy taken before sharding, filled by its init, its shards copied out and the whole freed,
so the shards hold exactly the values of the unsharded init and the host one layer at most.

Example::

    stages = stage_modules(model, balance=[2, 2], held=[1])    # [Absent(0), Sequential(...)]
    fill_shards({2: stages[1][0], 3: stages[1][1]}, templates, seeded_init(0), device)
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from giantpipe.engine.distributed.replicas import local_tensor, shard_like
from giantpipe.engine.meta import HOST, LayerInit, materialize


class Absent(nn.Module):
    """Stands for a stage held by another rank; running it is a bug, said plainly."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: Any) -> Any:
        raise RuntimeError(f"stage {self.stage} is not held by this rank")


def stage_bounds(balance: list[int]) -> list[int]:
    """The first layer of each stage, and the number of layers last.

    >>> stage_bounds([2, 3])
    [0, 2, 5]
    """
    return [sum(balance[:s]) for s in range(len(balance) + 1)]


def held_layers(balance: list[int], stages: Iterable[int]) -> list[int]:
    """The layers of ``stages``, in order.

    >>> held_layers([2, 3, 1], [0, 2])
    [0, 1, 5]
    """
    bounds = stage_bounds(balance)
    return [i for s in sorted(stages) for i in range(bounds[s], bounds[s + 1])]


def stage_modules(model: nn.Sequential, balance: list[int], held: list[int]) -> list[nn.Module]:
    """One module per stage of ``model`` cut by ``balance``: a Sequential keeping its layers'
    names (so parameter names are the plain model's) for each ``held`` stage, an
    :class:`Absent` for any other. Nothing is allocated."""
    bounds, named = stage_bounds(balance), list(model.named_children())
    return [
        nn.Sequential(OrderedDict(named[bounds[s] : bounds[s + 1]])) if s in held else Absent(s)
        for s in range(len(balance))
    ]


def templates(model: nn.Sequential, layers: Iterable[int]) -> dict[int, nn.Module]:
    """Meta copies of ``layers`` (nothing allocated), taken before the layers are sharded: what
    :func:`fill_shards` makes whole, one at a time."""
    return {i: copy.deepcopy(model[i]) for i in layers}


def fill_shards(
    layers: Mapping[int, nn.Module],
    meta_copies: Mapping[int, nn.Module],
    init: LayerInit | None,
    device: torch.device,
    tied: Collection[tuple[int, str]] = (),
) -> None:
    """Sets this rank's shards of ``layers`` (spread by FSDP2, allocated, by index) to their part
    of each layer's whole init: layer ``i`` made whole on the host from ``meta_copies[i]`` and
    filled by ``init(i, ...)``, each parameter's shard (as the sharded one is placed) copied
    out, the whole freed before the next layer. A parameter shared by several layers takes the
    first's values (``tied``: the (layer, name) places of parameters an earlier layer holds, which
    the copy of one layer cannot show). Buffers (which allocating the shards left empty) are
    the whole layer's.
    ``init`` None leaves the parameters unset (a checkpoint is loaded right after)."""
    filled: set[int] = set()
    for index in sorted(layers):
        whole = nn.Sequential(copy.deepcopy(meta_copies[index]))  # the copy stays on meta
        if init is not None:
            followers = [(0, name) for i, name in tied if i == index]
            materialize(whole, {0: HOST}, _at(init, index), followers)
        held = dict(layers[index].named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, value in whole[0].named_parameters(remove_duplicate=False):
                param = held[name]
                if init is not None and id(param) not in filled:
                    filled.add(id(param))
                    local_tensor(param).copy_(local_tensor(shard_like(value.detach(), param)))
            whole_buffers = dict(whole[0].named_buffers())
            for name, _ in layers[index].named_buffers():
                _set_buffer(layers[index], name, whole_buffers[name].to(device))
        del whole


def _at(init: LayerInit, index: int) -> LayerInit:
    """``init`` of layer ``index`` applied to the one-layer copy (layer 0 of it)."""

    def run(_: int, layer: nn.Module) -> None:
        init(index, layer)

    return run


def _set_buffer(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    path, _, attr = name.rpartition(".")
    setattr(layer.get_submodule(path) if path else layer, attr, value)
