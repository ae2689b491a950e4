"""Deterministic randomness for pipelined layers (dropout, drop-path).

Each RNG-using layer is seeded just before it runs from (step seed, layer, micro-batch, call
count), so thread timing and the cut change no mask and a recompute replays it
(docs/engine-internals.md#deterministic-randomness).

Example::

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)); _ = install_rng_hooks(model)
    >>> with rng_context(seed=7, microbatch=0, device=torch.device("cpu")):
    ...     a = model(torch.ones(2, 4))
    >>> with rng_context(seed=7, microbatch=0, device=torch.device("cpu")):
    ...     b = model(torch.ones(2, 4))
    >>> bool(a.eq(b).all())
    True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils.hooks import RemovableHandle

_local = threading.local()
_device_locks: dict[torch.device, threading.RLock] = {}
_locks_guard = threading.Lock()
_MASK = (1 << 63) - 1


def uses_rng(module: nn.Module) -> bool:
    """Whether a module draws random numbers in its own forward.

    Recognises dropout-like classes by name (``Dropout*``, ``AlphaDropout``, ``DropPath``,
    ``StochasticDepth``) and any module with ``giantpipe_uses_rng = True``.
    """
    if getattr(module, "giantpipe_uses_rng", False):
        return True
    name = type(module).__name__
    return any(key in name for key in ("Dropout", "DropPath", "StochasticDepth"))


@dataclass
class _Context:
    seed: int
    microbatch: int
    device: torch.device
    calls: dict[int, int] = field(default_factory=dict)


@contextmanager
def rng_context(seed: int, microbatch: int, device: torch.device) -> Iterator[None]:
    """Seeds RNG layers run by this thread from (``seed``, layer, ``microbatch``)."""
    previous = getattr(_local, "context", None)
    _local.context = _Context(seed, microbatch, torch.device(device))
    try:
        yield
    finally:
        _local.context = previous


def draw_step_seed() -> int:
    """One seed per step, drawn from the caller's default generator (so ``torch.manual_seed``
    before training fixes every mask of the run)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def mix(*values: int) -> int:
    """Mixes integers into a 63-bit seed (splitmix64 finaliser; stable across processes)."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & _MASK


def install_rng_hooks(module: nn.Module) -> RngHooks:
    """Adds seeding hooks to every RNG-using submodule of ``module``; returns their handles.

    A layer's number is its position among RNG layers in ``module.modules()``, so the same model
    gets the same numbers however it is later cut into stages.
    """
    return RngHooks([(i, sub) for i, sub in enumerate(m for m in module.modules() if uses_rng(m))])


class RngHooks(list[RemovableHandle]):
    """The seeding hooks' handles (a list: ``for h in hooks: h.remove()`` removes them).

    A dropout layer with p = 0 draws nothing and gets no hooks: a hooked module's every call
    takes PyTorch's slower path, about 35 µs a layer on a CPU here, 5% of the forward of a
    Transformer stage whose 19 dropout layers are all off. :meth:`refresh`, which both pipes
    call at every step, hooks a layer whose p has since become nonzero (and unhooks one whose
    p became 0), so the masks stay seeded whatever the caller changes between steps.

    Example::

        hooks = install_rng_hooks(model)
        model[1].p = 0.1          # a dropout switched on after the pipe was built
        hooks.refresh()           # now seeded like the others
    """

    def __init__(self, layers: list[tuple[int, nn.Module]]) -> None:
        super().__init__()
        self._layers = layers
        self._hooked: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Hooks exactly the layers that draw random numbers now."""
        for index, layer in self._layers:
            if _draws_nothing(layer) is (index not in self._hooked):
                continue  # hooked and drawing, or unhooked and drawing nothing
            if index in self._hooked:
                for handle in self._hooked.pop(index):
                    handle.remove()
            else:
                self._hooked[index] = (
                    layer.register_forward_pre_hook(_pre_hook(index)),
                    layer.register_forward_hook(_post_hook, always_call=True),
                )
        self[:] = [handle for pair in self._hooked.values() for handle in pair]


def _draws_nothing(module: nn.Module) -> bool:
    """A dropout layer with p = 0 draws no random numbers: seeding the generator for it (a
    state saved and restored, a lock) would cost more than the layer, for every call."""
    return isinstance(module, _DropoutNd) and module.p == 0


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


def _lock(device: torch.device) -> threading.RLock:
    with _locks_guard:
        return _device_locks.setdefault(device, threading.RLock())


def _pre_hook(index: int) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        ctx = getattr(_local, "context", None)
        if ctx is None or _draws_nothing(module):
            return
        call = ctx.calls.get(index, 0)
        ctx.calls[index] = call + 1
        lock = _lock(ctx.device)
        lock.acquire()
        generator = _generator(ctx.device)
        saved = generator.get_state()
        generator.manual_seed(mix(ctx.seed, index, ctx.microbatch, call))
        module._giantpipe_rng_saved = (lock, generator, saved)  # type: ignore[assignment]

    return hook


def _post_hook(module: nn.Module, args: Any, output: Any) -> None:
    saved = module.__dict__.pop("_giantpipe_rng_saved", None)
    if saved is not None:
        lock, generator, state = saved
        generator.set_state(state)
        lock.release()
