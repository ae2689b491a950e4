"""Live-bytes tracker: what a device would hold, measured op by op, also under fake tensors.

A :class:`LiveBytes` dispatch mode sees every aten op. Each storage an op returns is counted
once (views and in-place results share their storage and add nothing) and uncounted by a weakref
callback when the storage dies, so ``live`` follows allocations and frees exactly as a caching
allocator's "allocated bytes" would, minus rounding. Storages of fake tensors and meta tensors
have a size but no data, so a 1.8B-parameter model can be sized on a laptop (this is how
``torch.distributed._tools.mem_tracker.MemTracker`` works too, without its module bookkeeping).

Example::

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode(), LiveBytes() as mem:
    ...     x = torch.empty(1024, 1024)          # 4 MiB, never allocated
    ...     y = (x * 2).relu()                   # x * 2 dies as soon as relu returns
    >>> mem.peak
    12582912

Tensors made before the tracker was entered (parameters) are counted with :meth:`track`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages created by ops (plus those passed to :meth:`track`).

    ``live``: bytes alive now; ``peak``: the most alive at once since the last
    :meth:`reset_peak`. Thread-local like every dispatch mode: enter it in the thread that runs
    the ops (the pipeline stage runs in the caller's thread when measured, see ``stage.py``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def track(self, tensors: Iterable[Any]) -> int:
        """Counts the storages of ``tensors`` as live (once each); returns the bytes added.

        >>> mem = LiveBytes()
        >>> mem.track([torch.zeros(10), torch.zeros(5)])
        60
        """
        before = self.live
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return self.live - before

    def reset_peak(self) -> None:
        """Starts a new peak window at the current live bytes."""
        self.peak = self.live

    def _add(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        # The storage's Python object lives exactly as long as its C++ storage, so this fires
        # when the last tensor viewing it is gone: that is the free.
        weakref.finalize(storage, self._free, size)
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_iter(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tensor views counted once).

    >>> x = torch.zeros(4, 4)
    >>> storage_bytes([x, x[0], torch.zeros(2)])
    72
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())
