"""Every call to ``torch.distributed`` that moves data between ranks, recorded as a rank makes
it: its peer or group, communicator, tag and bytes, so that a test can replay a real run's
calls under NCCL's rule (:mod:`tests.support.nccl_rules`).

Example::

    log: list[dict[str, Any]] = []
    with recording(log):
        pipe.train_step(x, y, loss_fn)
    sends = [e for e in log if e["call"] == "isend"]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# Calls that move data between ranks. Object collectives are made of these and are recorded
# once, as themselves (they run on host groups).
RECORDED = (
    "isend",
    "irecv",
    "send",
    "recv",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",  # FSDP2's parameter all-gather
    "reduce_scatter_single",  # and its gradient reduce-scatter
    "broadcast",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _entry(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], main: int) -> dict[str, Any]:
    group = kwargs.get("group")
    ranks = dist.get_process_group_ranks(group) if group is not None else []
    if not ranks:
        ranks = list(range(dist.get_world_size()))
    peer = kwargs.get("dst", kwargs.get("src", -1))
    if name in ("isend", "irecv", "send", "recv") and len(args) > 1:
        peer = args[1]
    tensor = args[0] if args else kwargs.get("tensor")
    if name == "all_gather" and len(args) > 1:
        tensor = args[1]
    return {
        "call": name,
        "peer": int(peer) if isinstance(peer, int) else -1,
        "group": ranks,
        "comm": group.group_name if group is not None else dist.group.WORLD.group_name,
        "tag": int(kwargs.get("tag", 0)),
        "nbytes": _nbytes(tensor) if name != "barrier" else 0,
        "main_thread": threading.get_ident() == main,
    }


@contextmanager
def recording(log: list[dict[str, Any]]) -> Iterator[None]:
    """Every call of :data:`RECORDED` made in this process is appended to ``log``."""
    main = threading.get_ident()
    real = {name: getattr(dist, name) for name in RECORDED}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            log.append(_entry(name, args, kwargs, main))
            return fn(*args, **kwargs)

        return recorded

    for name, fn in real.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
