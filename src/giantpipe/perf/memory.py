"""Memory sized without allocating it: the live-bytes tracker, tensor specs and fake copies.

:class:`LiveBytesTracker` follows every storage aten ops make and free (fake and meta ones too,
so a large model is sized on a laptop), :class:`AllocatorTracker` reads the CUDA allocator, and
:class:`TensorSpec` makes a stage's inputs when it would receive them
(docs/performance.md#memory-without-allocating-it).

Example::

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode(), LiveBytesTracker() as mem:
    ...     x = torch.empty(1024, 1024)          # 4 MiB, never allocated
    ...     y = (x * 2).relu()                   # x * 2 dies as soon as relu returns
    >>> mem.peak
    12582912
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter
from torch.utils.weak import WeakIdKeyDictionary

from giantpipe.engine.step_config import LossFn


class LiveBytesTracker(TorchDispatchMode):
    """Counts the bytes of live storages created by ops (plus those passed to :meth:`track`).

    ``live``: bytes alive now; ``peak``: the most alive at once since the last
    :meth:`reset_peak`. Thread-local like every dispatch mode: enter it in the thread that runs
    the ops (a measured pipeline stage runs in the caller's thread, see ``stage_memory.py``).
    Tensors made before the tracker was entered (parameters) are counted with :meth:`track`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def track(self, tensors: Iterable[Any]) -> int:
        """Counts the storages of ``tensors`` as live (once each); returns the bytes added.

        >>> mem = LiveBytesTracker()
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


class AllocatorTracker:
    """The :class:`LiveBytesTracker` interface over the CUDA caching allocator's counters.

    Example::

        mem = AllocatorTracker(torch.device("cuda"))
        y = model(x)
        mem.live, mem.peak   # bytes allocated since the tracker started, now and at most
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)
        self.base = torch.cuda.memory_allocated(device)

    @property
    def live(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    @property
    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def track(self, tensors: Any) -> int:
        return self.live  # already allocated: everything since the tracker started

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


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


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor; ``grad``: whether the stage receives it requiring grad."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool = False

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype, device="meta").element_size()


Spec = TensorSpec | tuple[TensorSpec, ...]


@dataclass(frozen=True)
class StageLoss:
    """The last stage's loss: ``fn(output, target)``, targets made from ``target`` per chunk."""

    fn: LossFn
    target: Spec


def spec_of(x: Any, grad: bool = False) -> Spec:
    """The spec of a tensor or tuple of tensors; float tensors get ``grad``."""
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), x.dtype, grad and x.is_floating_point())
    return tuple(spec_of(t, grad) for t in x)  # type: ignore[misc]


def spec_bytes(spec: Spec) -> int:
    """Bytes of the tensors a spec describes (each counted, as separate copies on a device).

    >>> spec = spec_of((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))
    >>> spec_bytes(spec), [t.shape for t in make(spec)]
    (40, [torch.Size([2, 3]), torch.Size([2])])
    """
    if isinstance(spec, TensorSpec):
        return spec.nbytes
    return sum(s.nbytes for s in spec)


def make(spec: Spec, device: torch.device | str = "cpu") -> Any:
    """Fresh tensors for ``spec`` (zeros for integer ids, so embeddings index validly)."""
    if isinstance(spec, tuple):
        return tuple(make(s, device) for s in spec)
    t = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    return t.requires_grad_(spec.grad)


def make_grads(spec: Spec, device: torch.device | str = "cpu") -> tuple[Any, ...]:
    """Incoming output gradients for ``spec``: ones for floats, None for ids and masks."""
    specs = (spec,) if isinstance(spec, TensorSpec) else spec
    return tuple(
        torch.ones(s.shape, dtype=s.dtype, device=device) if s.dtype.is_floating_point else None
        for s in specs
    )


def as_fake(module: nn.Module) -> tuple[nn.Module, FakeTensorMode]:
    """Turns a meta ``module`` into fake CPU tensors, in place; returns it and its fake mode.

    A module whose tensors are already fake is returned as it is. Fake tensors have shapes and
    storages with sizes, no data: a 5B-parameter stage costs nothing to hold.

    >>> with torch.device("meta"):
    ...     layer = nn.Linear(4, 4)
    >>> fake, mode = as_fake(layer)
    >>> type(fake.weight.data).__name__, fake.weight.device.type
    ('FakeTensor', 'cpu')
    """
    param = next(module.parameters())
    mode = getattr(param, "fake_mode", None)
    if mode is not None:
        return module, mode
    if param.device.type != "meta":
        raise ValueError(f"expected meta or fake parameters, got {param.device} tensors")
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}  # tied parameters stay tied
    with mode:
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(_empty_like(p), p.requires_grad)
                setattr(sub, name, made[id(p)])
            for name, b in list(sub.named_buffers(recurse=False)):
                setattr(sub, name, _empty_like(b))
    return module, mode


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")
