"""What a process holds: the bytes of its training state (parameters, gradients, optimizer
state, each counted by the storage it lives in, so an FSDP2 shard counts as its own part) and of
every live tensor (CPU has no allocator statistics: the garbage collector's list stands in, and
the gradients of the leaves it lists, which autograd writes with no Python object).

Example::

    state = training_bytes(pipe.parameters(), optimizer)   # {"params": ..., "grads": ..., ...}
    live = live_bytes()                                    # every live tensor's storage, once
    done, peak = peak_above_start(lambda: export(...))     # the most RSS rose during a call
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch

from giantpipe.engine.distributed.replicas import local_tensor

__all__ = ["live_bytes", "peak_above_start", "storage_bytes", "training_bytes"]

_T = TypeVar("_T")


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages ``tensors`` live in: a DTensor's local shard (with
    FSDP2's padding of dim 0 to a multiple of the mesh), any other tensor's own.

    >>> w = torch.zeros(4, 2)
    >>> storage_bytes([w, w[1:]])     # one storage, 8 floats
    32
    """
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor.detach()).untyped_storage()
        if storage.data_ptr() != 0:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_bytes(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes of ``params``, of their gradients and of ``optimizer``'s state tensors.

    >>> w = torch.nn.Parameter(torch.zeros(4)); w.grad = torch.ones(4)
    >>> training_bytes([w])
    {'params': 16, 'grads': 16, 'optimizer': 0}
    """
    held = list(params)
    grads = [p.grad for p in held if p.grad is not None]
    state = [] if optimizer is None else list(optimizer.state.values())
    slots = [t for s in state for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "params": storage_bytes(held),
        "grads": storage_bytes(grads),
        "optimizer": storage_bytes(slots),
    }


def live_bytes() -> int:
    """The bytes of the storages of every live tensor of this process, each once (meta tensors
    and fake ones, which hold nothing, left out).

    >>> before = live_bytes(); block = torch.zeros(1024); live_bytes() - before >= 4096
    True
    """
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance: a deprecated module attribute warns when asked its __class__
        if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":
            continue
        # A gradient autograd wrote has no Python object until someone reads ``.grad``: the
        # collector would not list it, so it is counted through its leaf.
        grad = obj.grad if obj.is_leaf and obj.requires_grad else None
        for tensor in (obj, grad) if grad is not None else (obj,):
            try:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a DTensor (its local tensor is listed) or a fake tensor
                continue
    storages.pop(0, None)  # empty tensors
    return sum(storages.values())


def peak_above_start(call: Callable[[], _T]) -> tuple[_T, int]:
    """``call()``'s result, and the most this process's resident memory rose above where it
    was when the call began (Linux: the peak, ``VmHWM``, is reset first through
    ``/proc/self/clear_refs``)."""

    def status(key: str) -> int:
        found = re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(found.group(1)) * 1024 if found else 0

    Path("/proc/self/clear_refs").write_text("5")
    start = status("VmRSS")
    result = call()
    return result, status("VmHWM") - start
