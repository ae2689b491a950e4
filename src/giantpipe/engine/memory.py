"""Activation memory measured, not estimated: bytes autograd saves for backward.

On CPU there is no allocator to ask, so the engine counts what a forward pass really keeps alive
for backward: every tensor autograd saves, deduplicated by storage, parameters excluded (they are
resident anyway). On CUDA the allocator's peak is reported as well.

Example::

    >>> layer = nn.Linear(256, 256)
    >>> meter = SavedTensorMeter(exclude=layer.parameters())
    >>> with meter:
    ...     y = layer(torch.randn(8, 256, requires_grad=True)).relu()
    >>> meter.bytes  # the input of the matmul and the ReLU result: 2 x 8 x 256 x 4
    16384
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch


class SavedTensorMeter:
    """Context manager that sums the bytes of distinct storages saved for backward.

    Relies on ``torch.autograd.graph.saved_tensors_hooks``, which is thread-local, so each
    pipeline worker meters only its own stage.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def ignore(self, tensors: Iterable[object]) -> None:
        """Treats the storages of ``tensors`` as already counted (e.g. stage inputs)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._seen.add(t.untyped_storage().data_ptr())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Views share a storage; count each storage once. Meta and fake tensors have no data.
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._exclude and key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        # Keep a detached alias (same storage and version counter, no grad_fn), not the tensor:
        # a saved output held by its own node through a hook is a cycle through C++ that
        # Python's collector cannot see, so a graph retained for a later weight-gradient (W)
        # would never be freed. (Double backward through metered code is not supported.)
        return tensor.detach()

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)


def _unpack(tensor: Any) -> Any:
    return tensor


def reset_device_peak(device: torch.device) -> None:
    """Resets the CUDA allocator's peak counter (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak(device: torch.device) -> int:
    """The CUDA allocator's peak bytes since the last reset (0 on other devices)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return 0
