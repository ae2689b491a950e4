"""Partitioning: cut a flat ``nn.Sequential`` into K contiguous stages on K devices.

Example::

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    >>> stages = split_module(model, [2, 1], [torch.device("cpu")] * 2)
    >>> [len(s) for s in stages]
    [2, 1]

The stages hold the very same layer objects as ``model`` (no copy), each moved to its device, and
each keeps the layer's original name so that parameter names do not depend on the cut:
``"0.weight"`` where torchgpipe says ``"partitions.0.0.weight"`` (:func:`plain_names` reads
torchgpipe's state dicts).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

Device = int | str | torch.device


class BalanceError(ValueError):
    """A balance that does not describe the module (wrong sum, non-positive entry)."""


def verify_module(module: nn.Module) -> None:
    """Checks that ``module`` is a flat Sequential whose layers can be placed independently.

    A layer shared by two positions, or a parameter shared by two layers, would have to live on
    two devices at once; both are rejected here rather than silently desynchronised later.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    children = list(module.named_children())
    if len(children) != len(module):
        raise ValueError("module with duplicate children is not supported")
    owner: dict[int, str] = {}
    for name, child in children:
        for param in child.parameters():
            if id(param) in owner and owner[id(param)] != name:
                raise ValueError(
                    "module with duplicate parameters in distinct children is not supported "
                    f"(layers {owner[id(param)]} and {name} share a parameter)"
                )
            owner[id(param)] = name


def verify_balance(num_layers: int, balance: Sequence[int], num_devices: int) -> list[int]:
    """Validates a balance (layer counts per stage) and returns it as a list of ints.

    >>> verify_balance(5, [2, 3], 2)
    [2, 3]
    """
    balance = [int(b) for b in balance]  # empty for an empty module: the identity, as torchgpipe
    if num_layers != sum(balance):
        raise BalanceError(
            "module and sum of balance have different length "
            f"(module: {num_layers}, sum of balance: {sum(balance)})"
        )
    if any(b <= 0 for b in balance):
        raise BalanceError(f"all balance numbers must be positive integer (balance: {balance})")
    if len(balance) > num_devices:
        raise IndexError(
            "too few devices to hold given partitions "
            f"(devices: {num_devices}, partitions: {len(balance)})"
        )
    return balance


def resolve_devices(devices: Iterable[Device] | None, num_partitions: int) -> list[torch.device]:
    """Turns user devices into ``torch.device`` objects.

    ``None`` means every visible CUDA device or, without CUDA, ``num_partitions`` CPU stand-ins.
    An integer ``i`` means ``cuda:i``.
    """
    if devices is None:
        count = torch.cuda.device_count()
        devices = range(count) if count else ["cpu"] * num_partitions
    resolved = []
    for d in devices:
        resolved.append(torch.device("cuda", d) if isinstance(d, int) else torch.device(d))
    return resolved


def split_module(
    module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]
) -> list[nn.Sequential]:
    """Cuts ``module`` into ``len(balance)`` stages and moves stage k to ``devices[k]``."""
    stages = []
    layers = iter(module.named_children())
    for count, device in zip(balance, devices):
        named = OrderedDict(next(layers) for _ in range(count))
        stage = nn.Sequential(named)
        stage.to(device)
        stages.append(stage)
    return stages


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
