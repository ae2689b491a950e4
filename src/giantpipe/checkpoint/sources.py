"""Tensors by name from one source (a checkpoint, a weights file), only those asked for read.

A source lists its names and reads the ones asked for; each format has its own: DCP saves
(:class:`giantpipe.checkpoint.load.DcpTensors`), tensors already at hand or mapped from a file
(:class:`HeldTensors`), the earlier formats (:mod:`giantpipe.checkpoint.earlier`).

>>> source = HeldTensors("w.pt", {"0.weight": torch.ones(2)})
>>> source.names(), source.read(["0.weight"])["0.weight"].tolist()
(['0.weight'], [1.0, 1.0])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from giantpipe.checkpoint.errors import MissingTensors

__all__ = ["Chained", "HeldTensors", "TensorLayout", "TensorSource"]


@dataclass(frozen=True)
class TensorLayout:
    """What a tensor is, known before its bytes are read: dtype and shape.

    >>> TensorLayout(torch.bfloat16, (4, 8)).nbytes
    64
    """

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: Tensor) -> TensorLayout:
        return cls(tensor.dtype, tuple(tensor.shape))


class TensorSource(Protocol):
    """Where tensors are read by name (``path`` is what errors name)."""

    path: Path

    def names(self) -> list[str]:
        """Every tensor name the source holds."""
        ...

    def layout(self, name: str) -> TensorLayout:
        """The dtype and shape of the tensor ``name`` (its bytes unread)."""
        ...

    def read(
        self, names: Iterable[str], like: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The tensors ``names``, in host memory (a name ``like`` maps to a DTensor may come back
        as such a DTensor, only this rank's part read); MissingTensors for any it lacks."""
        ...


class HeldTensors:
    """Tensors at hand (or mapped from a file, ``torch.load(mmap=True)``); a read copies out
    only the ones asked for. ``load``, when given, is called once on the first read."""

    def __init__(
        self,
        path: str | Path,
        tensors: Mapping[str, Tensor] | None = None,
        load: Callable[[], Mapping[str, Tensor]] | None = None,
    ) -> None:
        self.path = Path(path)
        self._tensors, self._load = tensors, load

    def held(self) -> Mapping[str, Tensor]:
        if self._tensors is None:
            self._tensors = self._load() if self._load is not None else {}
        return self._tensors

    def names(self) -> list[str]:
        return list(self.held())

    def layout(self, name: str) -> TensorLayout:
        if name not in self.held():
            raise MissingTensors(self.path, [name])
        return TensorLayout.of(self.held()[name])

    def read(
        self, names: Iterable[str], like: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        held, wanted = self.held(), list(names)
        missing = [n for n in wanted if n not in held]
        if missing:
            raise MissingTensors(self.path, missing)
        return {n: held[n].detach().clone() for n in wanted}


class Chained:
    """Several sources read as one; a name is read from the first source that holds it."""

    def __init__(self, path: str | Path, sources: list[TensorSource]) -> None:
        self.path, self.sources = Path(path), sources

    def names(self) -> list[str]:
        return list(dict.fromkeys(n for s in self.sources for n in s.names()))

    def layout(self, name: str) -> TensorLayout:
        for source in self.sources:
            if name in source.names():
                return source.layout(name)
        raise MissingTensors(self.path, [name])

    def read(
        self, names: Iterable[str], like: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        wanted, found = list(names), {}
        for source in self.sources:
            held = set(source.names())
            mine = [n for n in wanted if n in held and n not in found]
            if mine:
                found.update(source.read(mine, like))
        missing = [n for n in wanted if n not in found]
        if missing:
            raise MissingTensors(self.path, missing)
        return {n: found[n] for n in wanted}
