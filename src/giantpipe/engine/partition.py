"""Partitioning: cut a flat ``nn.Sequential`` into K contiguous stages on K devices.

The stages hold the very layer objects (no copy) under their original names (``"0.weight"``;
:func:`plain_names` reads torchgpipe's); a parameter tied across devices gets a copy per device
(:class:`TiedCopies`): docs/engine-internals.md#tied-parameters.

Example::

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    >>> stages = split_module(model, [2, 1], [torch.device("cpu")] * 2)
    >>> [len(s) for s in stages]
    [2, 1]
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

Device = int | str | torch.device


def verify_module(module: nn.Module) -> None:
    """Checks that ``module`` is a flat Sequential whose layers can be placed independently.

    A layer at two positions would have to run as two stages with one set of activations: it is
    rejected. A parameter shared by two layers (tied embeddings) is kept tied by the engine
    (:class:`TiedCopies`), so it is allowed, unlike in torchgpipe.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    children = list(module.named_children())
    if len(children) != len(module):
        raise ValueError("module with duplicate children is not supported")


def shared_parameters(module: nn.Sequential) -> list[list[tuple[int, str]]]:
    """Parameters held by more than one layer, each as its places ``(layer index, name in the
    layer)``, in layer order.

    >>> embed = nn.Embedding(10, 4)
    >>> head = nn.Linear(4, 10, bias=False)
    >>> head.weight = embed.weight
    >>> shared_parameters(nn.Sequential(embed, nn.ReLU(), head))
    [[(0, 'weight'), (2, 'weight')]]
    """
    places: dict[int, list[tuple[int, str]]] = {}
    for index, layer in enumerate(module):
        for name, param in layer.named_parameters(remove_duplicate=False):
            found = places.setdefault(id(param), [])
            if not any(i == index for i, _ in found):
                found.append((index, name))
    return [group for group in places.values() if len(group) > 1]


def resolve_devices(
    devices: Iterable[Device] | None,
    num_partitions: int,
    current: Callable[[], int] = torch.cuda.current_device,
) -> list[torch.device]:
    """Turns user devices into ``torch.device`` objects, every CUDA one with its index.

    ``None`` means every visible CUDA device or, without CUDA, ``num_partitions`` CPU stand-ins.
    An integer ``i`` means ``cuda:i``; ``"cuda"`` means the current CUDA device (``current()``,
    see :func:`with_index`).

    >>> resolve_devices(["cuda", 1, "cpu"], 3, current=lambda: 0)
    [device(type='cuda', index=0), device(type='cuda', index=1), device(type='cpu')]
    """
    if devices is None:
        count = torch.cuda.device_count()
        devices = range(count) if count else ["cpu"] * num_partitions
    resolved = []
    for d in devices:
        device = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        resolved.append(with_index(device, current))
    return resolved


def with_index(
    device: torch.device, current: Callable[[], int] = torch.cuda.current_device
) -> torch.device:
    """``device`` with its index: an index-less CUDA device is the current one, ``current()``.

    ``torch.device("cuda") != torch.device("cuda:0")``, so two stages given ``"cuda"`` and
    ``"cuda:0"`` would look like two devices (two copies of a tied parameter, two copy streams,
    two allocator peaks, ...); and the current device is thread-local, so ``"cuda"`` would mean
    cuda:0 in every worker thread whatever the caller's. The index is fixed once, here.

    >>> with_index(torch.device("cuda"), current=lambda: 1)
    device(type='cuda', index=1)
    >>> with_index(torch.device("cpu"))
    device(type='cpu')
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current())
    return device


def split_module(
    module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]
) -> list[nn.Sequential]:
    """Cuts ``module`` into ``len(balance)`` stages and moves stage k to ``devices[k]``.

    A parameter shared by layers on different devices is copied first (one copy per device,
    the first stage's being the original); :func:`tied_copies` finds the copies again.
    """
    _untie_across_devices(module, balance, devices)
    stages = []
    layers = iter(module.named_children())
    for count, device in zip(balance, devices):
        named = OrderedDict(next(layers) for _ in range(count))
        stage = nn.Sequential(named)
        stage.to(device)
        stages.append(stage)
    return stages


def _untie_across_devices(
    module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]
) -> None:
    # Module.to moves a parameter in place: one object held on two devices would end up on the
    # last one. So each further device gets its own Parameter, shared by its layers.
    device_of = [d for count, d in zip(balance, devices) for _ in range(count)]
    for places in shared_parameters(module):
        first = module[places[0][0]].get_parameter(places[0][1])
        copies = {device_of[places[0][0]]: first}
        for index, name in places[1:]:
            device = device_of[index]
            if device not in copies:
                copies[device] = nn.Parameter(first.detach().clone(), first.requires_grad)
            _set_parameter(module[index], name, copies[device])


def _set_parameter(layer: nn.Module, name: str, param: nn.Parameter) -> None:
    path, _, attr = name.rpartition(".")
    (layer.get_submodule(path) if path else layer).register_parameter(attr, param)


def tied_copies(
    stages: Sequence[nn.Module], groups: Sequence[Sequence[tuple[int, str]]]
) -> list[list[nn.Parameter]]:
    """The distinct copies of each shared parameter (``groups`` from :func:`shared_parameters`,
    layer indices counted over all stages), first stage's first; groups with one copy left out.
    """
    layers = [layer for stage in stages for layer in cast(nn.Sequential, stage)]
    found = []
    for places in groups:
        copies: dict[int, nn.Parameter] = {}
        for index, name in places:
            param = layers[index].get_parameter(name)
            copies.setdefault(id(param), param)
        if len(copies) > 1:
            found.append(list(copies.values()))
    return found


def set_aside_gradients(params: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Takes the gradients already in ``p.grad`` out (``p.grad`` becomes None), by ``id(p)``:
    a step then sums only its own part, and the part set aside is added back after.

    >>> w = nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
    >>> held = set_aside_gradients([w])
    >>> w.grad is None and held[id(w)].tolist() == [1.0, 1.0]
    True
    """
    held = {}
    for p in params:
        if p.grad is not None:
            held[id(p)], p.grad = p.grad, None
    return held


class TiedCopies:
    """Keeps the per-device copies of tied parameters equal: their gradients are summed once
    per step (``begin`` before it, ``finish`` after its backward), so every copy takes the same
    optimizer step. Gradients already accumulated before ``begin`` are kept as they are.

    Example::

        tied = TiedCopies(tied_copies(stages, shared_parameters(model)))
        tied.begin()
        ...                      # a step's forward and backward
        tied.finish()            # wte.grad == wte_copy.grad == the sum of both uses
    """

    def __init__(self, groups: Sequence[Sequence[nn.Parameter]]) -> None:
        self.groups = [list(g) for g in groups]
        self._held: dict[int, torch.Tensor] = {}

    def begin(self) -> None:
        self._held = set_aside_gradients(p for copies in self.groups for p in copies)

    def finish(self) -> None:
        for copies in self.groups:
            owner = copies[0]
            total = torch.zeros_like(owner)
            for p in copies:
                if p.grad is not None:
                    total += p.grad.to(owner.device)
            for p in copies:
                grad = total if p is owner else total.to(p.device, copy=True)
                held = self._held.pop(id(p), None)
                p.grad = grad if held is None else held + grad

    def followers(self) -> list[nn.Parameter]:
        """Every copy but the first of each group: left out of a global norm, counted once."""
        return [p for copies in self.groups for p in copies[1:]]

    def follow(self) -> None:
        """Gives every copy the first copy's gradient again (after clipping scaled it)."""
        for owner, *rest in self.groups:
            for p in rest:
                if owner.grad is not None and p.grad is not None:
                    p.grad.copy_(owner.grad)


_PARTITIONED = re.compile(r"partitions\.\d+\.")


def plain_names(state_dict: dict[str, Any], prefix: str = "") -> None:
    """Renames, in place, torchgpipe's keys under ``prefix`` (``partitions.K.NAME...``: a
    partition K holding the layer NAME) to the plain model's (``NAME...``), metadata too.

    >>> sd = {"partitions.1.2.weight": 0}
    >>> plain_names(sd)
    >>> sd
    {'2.weight': 0}
    """
    metadata = getattr(state_dict, "_metadata", None)
    for table in (state_dict, metadata or {}):
        for key in [k for k in table if k.startswith(prefix)]:
            match = _PARTITIONED.match(key, len(prefix))
            if match is not None:
                table[prefix + key[match.end() :]] = table.pop(key)
