"""A run's checkpoint read back: where the run was, its tensors by name (weights, the
optimizer's, the EMA's) and each rank's run state, whatever format wrote it.

Example::

    run = open_run(Path("outputs/run/last"))     # CheckpointError naming what is wrong
    run.step, run.position, run.ema              # 100, 800, False
    run.tensors.read(["0.weight", "optimizer/0.weight/exp_avg"])
    read_checkpoint(Path("outputs/run/last"))["model"]      # every weight, merged
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from giantpipe.checkpoint.earlier import SHARDS_V1, one_file, shards_v1_run
from giantpipe.checkpoint.errors import CheckpointError
from giantpipe.checkpoint.load import DcpTensors
from giantpipe.checkpoint.manifest import read_manifest, verify, weight_names
from giantpipe.checkpoint.names import EMA, MANIFEST
from giantpipe.checkpoint.sources import TensorSource
from giantpipe.checkpoint.unpickling import safe_load

__all__ = ["RUN_FORMAT", "RunCheckpoint", "open_run", "read_checkpoint"]

RUN_FORMAT = "giantpipe-run/1"
"""The manifest's ``extra.format`` of a checkpoint the runner wrote (weights and run state)."""


@dataclass
class RunCheckpoint:
    """A run's checkpoint opened for reading (:func:`open_run`)."""

    path: Path
    step: int
    """Optimizer steps done."""
    position: int
    """Training batches consumed."""
    ema: bool
    """Whether it holds an EMA of the weights (``ema/NAME``)."""
    balance: list[int]
    workers: int
    weights: list[str]
    """The model's tensor names (every rank's)."""
    tensors: TensorSource
    """Every tensor by name: the weights, ``optimizer/NAME/KEY`` and ``ema/NAME``."""
    ranks: int
    """How many ranks saved a run state."""
    leaders: list[int]
    """The ranks of replica 0, whose run states hold the optimizer's other values."""
    read_state: Callable[[int], dict[str, Any]]
    window: dict[str, Any] | None = None
    """The metrics' logging window the save cut (partial sums), None where the format has none."""
    _states: dict[int, dict[str, Any]] = field(default_factory=dict)

    def state_of(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s run state: LR schedule, RNG, fp16's loss scale, the optimizer's
        parameter groups and values other than tensors."""
        if rank not in self._states:
            self._states[rank] = self.read_state(rank)
        return self._states[rank]

    def leader_states(self) -> list[dict[str, Any]]:
        """The run states of replica 0's ranks, in rank order."""
        return [self.state_of(r) for r in self.leaders]


def open_run(path: Path) -> RunCheckpoint:
    """The run checkpoint at ``path`` (a directory with a manifest, or an earlier one-file
    ``last.pt``); CheckpointError naming the file when it is none or cannot be read."""
    if path.is_file():
        fields, earlier = one_file(path)
        balance = list(fields["balance"])
        return RunCheckpoint(
            path=path,
            step=fields["step"],
            position=fields["position"],
            ema=fields["ema"],
            balance=balance,
            workers=len(balance),
            weights=fields["weights"],
            tensors=earlier.tensors,
            ranks=len(earlier.states),
            leaders=earlier.leaders,
            read_state=earlier.states.__getitem__,
        )
    manifest, extra = _run_manifest(path)
    files = list(extra["state_files"])
    tensors: TensorSource
    read_state: Callable[[int], dict[str, Any]]
    if manifest["format"] == SHARDS_V1:
        earlier = shards_v1_run(path, manifest, extra)
        tensors, read_state = earlier.tensors, earlier.states.__getitem__
    else:
        tensors = DcpTensors(path, manifest)
        read_state = functools.partial(_state_file, path, manifest, files)
    return RunCheckpoint(
        path=path,
        step=int(extra["step"]),
        position=int(extra["position"]),
        ema=bool(extra["ema"]),
        balance=list(manifest["balance"]),
        workers=int(manifest["workers"]),
        weights=weight_names(manifest),
        tensors=tensors,
        ranks=len(files),
        leaders=list(extra["leader_ranks"]),
        read_state=read_state,
        window=extra.get("window"),
    )


def _state_file(
    path: Path, manifest: dict[str, Any], files: list[str], rank: int
) -> dict[str, Any]:
    """Rank ``rank``'s run-state file, checked against the manifest's hash first."""
    verify(path, manifest, [files[rank]])
    state: dict[str, Any] = safe_load(path / files[rank], mmap=True)
    return state


def _run_manifest(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run checkpoint's manifest and its run entry (``extra``)."""
    if not (path / MANIFEST).is_file():
        raise CheckpointError(path, f"holds no checkpoint (no {MANIFEST})")
    try:
        manifest = read_manifest(path)
    except OSError as err:
        raise CheckpointError(path, f"is not a readable checkpoint ({err})") from err
    extra: dict[str, Any] = manifest.get("extra") or {}
    if extra.get("format") != RUN_FORMAT:
        raise CheckpointError(
            path,
            "holds weights without run state; start a new run from them with "
            "python -m giantpipe.consolidate DIR model.pt and trainer.init_from=model.pt",
        )
    return manifest, extra


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A run's checkpoint as one mapping, to look into: ``step``, ``position``, ``model`` (every
    weight, merged), ``ema`` (merged, or None), ``balance`` and ``workers``. Every file read is
    checked against the manifest's hashes first.

    Example::

        read_checkpoint(Path("outputs/2026-12-01/10-00-00/last"))["step"]   # 120
    """
    run = open_run(Path(path))
    ema: dict[str, Tensor] | None = None
    if run.ema:
        names = [n for n in run.tensors.names() if n.startswith(EMA)]
        ema = {n[len(EMA) :]: t for n, t in run.tensors.read(names).items()}
    return {
        "step": run.step,
        "position": run.position,
        "model": run.tensors.read(run.weights),
        "ema": ema,
        "balance": run.balance,
        "workers": run.workers,
    }
