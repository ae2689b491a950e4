"""GPipe's arguments, checked before anything is built (torchgpipe's messages where it has one).

Example::

    checked = check_arguments(model, [2, 1], ["cpu", "cpu"], 4, "except_last", "gpipe", None)
    checked.balance, checked.chunks, checked.virtual_stages, checked.devices
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from giantpipe.engine.microbatch import TensorOrTensors
from giantpipe.engine.partition import (
    BalanceError,
    Device,
    resolve_devices,
    verify_balance,
    verify_module,
)
from giantpipe.engine.recompute import MODES


class Arguments(NamedTuple):
    """GPipe's layout as checked: layers per stage, M, V, and one device per worker."""

    balance: list[int]
    chunks: int
    virtual_stages: int
    devices: list[torch.device]


def check_arguments(
    module: nn.Sequential,
    balance: Iterable[int] | None,
    devices: Iterable[Device] | None,
    chunks: int,
    checkpoint: str,
    schedule: str,
    virtual_stages: int | None,
) -> Arguments:
    """Checks GPipe's arguments in torchgpipe's order; raises ValueError (TypeError for the
    module) naming the first bad one."""
    if balance is None:
        raise ValueError(
            "balance is required; compute one with giantpipe.engine.balance_by_time, "
            "balance_by_size or balance_by_params"
        )
    chunks = int(chunks)
    if chunks <= 0:
        raise ValueError("number of chunks must be positive integer")
    if checkpoint not in MODES:
        raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
    verify_module(module)
    balance = list(balance)
    v = _virtual_stages(schedule, virtual_stages, len(balance))
    workers = len(balance) // v
    resolved = resolve_devices(devices, workers)
    try:
        balance = verify_balance(len(module), balance, len(resolved) * v)
    except BalanceError as exc:
        raise ValueError(str(exc)) from exc
    return Arguments(balance, chunks, v, resolved)


def _virtual_stages(schedule: str, virtual_stages: int | None, num_stages: int) -> int:
    """V: as given, else 2 for 'interleaved' and 1 otherwise; K*V must be the balance's length."""
    v = (
        int(virtual_stages)
        if virtual_stages is not None
        else (2 if schedule == "interleaved" else 1)
    )
    if v < 1:
        raise ValueError(f"virtual_stages must be positive (got {v})")
    if num_stages % v:
        raise ValueError(
            f"with virtual_stages={v}, balance must list K*V stages (a multiple of {v}); "
            f"got {num_stages} entries"
        )
    return v


def check_input(input: Any) -> TensorOrTensors:
    if isinstance(input, torch.Tensor):
        return input
    if isinstance(input, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in input):
        return tuple(input)
    raise TypeError(f"expected Tensor or Tuple[Tensor, ...], but got {type(input).__name__}")
