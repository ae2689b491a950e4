"""A checkpoint or weights file that cannot be read as asked, said in one line naming the file.

The package knows no config key: the runner names the setting that asked for the file
(``trainer.resume``, ``trainer.init_from``) and turns these into its one-line ``ConfigError``.

Example::

    try:
        load(Path("ckpt"), ["0.weight"])
    except CheckpointError as err:
        print(err)      # ckpt/step.../__0_0.distcp is damaged (content hash differs from ...)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """``str(err)`` is ``"{path} {problem}"``, one line: ``ckpt/model.pt is not a readable
    checkpoint (not a torch file)``; ``err.path`` is the file or directory."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(self.describe(Path(path), problem))
        self.path, self.problem = Path(path), problem

    @staticmethod
    def describe(path: Path, problem: str) -> str:
        return f"{path} {problem}"

    def __reduce__(self) -> tuple[Any, tuple[Path, str]]:  # crosses processes whole
        return type(self), (self.path, self.problem)


class CheckpointDamaged(CheckpointError):
    """A file that differs from what its manifest committed, or cannot be read at all:
    ``ckpt/step.../__0_0.distcp is damaged (content hash differs from the commit record)``."""

    @staticmethod
    def describe(path: Path, problem: str) -> str:
        return f"{path} is damaged ({problem})"


class MissingTensors(CheckpointError):
    """Tensors asked for by name that a checkpoint or weights file does not hold;
    ``err.names`` lists them all, the message the first five."""

    def __init__(self, path: str | Path, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        super().__init__(path, f"holds no tensor {shown} ({len(names)} missing)")
        self.names = list(names)

    def __reduce__(self) -> tuple[Any, tuple[Path, list[str]]]:  # type: ignore[override]
        return MissingTensors, (self.path, self.names)
