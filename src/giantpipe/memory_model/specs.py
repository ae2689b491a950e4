"""Shapes of what crosses a stage boundary, and tensors made from them on demand.

A stage is measured alone, so its inputs (activations from the previous stage) and its output
gradients (from the next one) are made from specs at the moment the real pipeline would receive
them. Under ``FakeTensorMode`` the tensors made here are fake: shapes without memory.

Example::

    >>> spec = spec_of((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))
    >>> spec_bytes(spec)
    40
    >>> [t.shape for t in make(spec)]
    [torch.Size([2, 3]), torch.Size([2])]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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


def spec_of(x: Any, grad: bool = False) -> Spec:
    """The spec of a tensor or tuple of tensors; float tensors get ``grad``."""
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), x.dtype, grad and x.is_floating_point())
    return tuple(spec_of(t, grad) for t in x)  # type: ignore[misc]


def spec_bytes(spec: Spec) -> int:
    """Bytes of the tensors a spec describes (each counted, as separate copies on a device)."""
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
