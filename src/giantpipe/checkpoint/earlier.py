"""The earlier checkpoint formats and renamed keys: what is still read, how, and until when.

The one place that decides it (docs/checkpoints.md#earlier-formats says the same for users):
each earlier format is read by every giantpipe release before :data:`READ_BEFORE`, then its
reader goes; ``tests/unit/checkpoint/test_earlier.py`` reads each one and fails once the
version reaches that release. A reader turns what it finds into today's names, so the rest of
the package sees one format (:data:`RENAMED`).

Example::

    source = shard_files(Path("old/last"), manifest)        # giantpipe-shards/1 weights
    run = one_file(Path("old/last.pt"))                     # step, tensors, run state
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError, MissingTensors
from giantpipe.checkpoint.names import EMA, OPTIMIZER
from giantpipe.checkpoint.sources import Chained, HeldTensors, TensorLayout, TensorSource
from giantpipe.checkpoint.unpickling import safe_load

__all__ = [
    "ONE_FILE",
    "READ_BEFORE",
    "RENAMED",
    "SHARDS_V1",
    "SHARDS_V1_FILE",
    "SHARDS_V2",
    "EarlierRun",
    "ShardFiles",
    "one_file",
    "renamed_tensors",
    "shard_files",
    "shards_v1_run",
]

READ_BEFORE = "0.3.0"
"""The first release that no longer reads the formats below (giantpipe 0.1 wrote them last)."""
SHARDS_V1 = "giantpipe-shards/1"
"""A manifest beside one ``torch.save`` file of weights per rank and one of run state per rank
(no hashes): DCP replaced it in giantpipe 0.1."""
SHARDS_V1_FILE = re.compile(r"(state-)?step\d{9}-[0-9a-f]{6}-rank\d{5}\.pt")
"""Its files (weights, and the run state)."""
SHARDS_V2 = "giantpipe-shards/2"
"""Today's layout, each data file hashed whole rather than per block: a data file is checked
whole before any of it is read."""
ONE_FILE = "last.pt"
"""One ``torch.save`` file holding a local run's whole state, before the manifest."""
ONE_FILE_KEYS = ("format_version", "step", "position", "model", "optimizer", "rng")
RENAMED = {
    "run state: optimizer.state.NAME.KEY (a tensor)": f"the tensor {OPTIMIZER}NAME/KEY",
    "run state: ema.NAME": f"the tensor {EMA}NAME",
    f"{ONE_FILE}: model.NAME": "the tensor NAME",
    "run state without grad_scaler (saved before fp16)": "grad_scaler None: the initial scale",
}
"""Earlier keys -> where today's readers find them."""


class ShardFiles:
    """The weights of a ``giantpipe-shards/1`` save: one ``torch.save`` file per rank, each
    opened (mapped, not read) only when one of its names is asked for."""

    def __init__(self, folder: Path, where: Mapping[str, str]) -> None:
        self.path, self.where = folder, dict(where)
        self._opened: dict[str, Mapping[str, Tensor]] = {}

    def names(self) -> list[str]:
        return list(self.where)

    def layout(self, name: str) -> TensorLayout:
        return TensorLayout.of(self._tensor(name))

    def read(
        self, names: Iterable[str], like: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        return {n: self._tensor(n).clone() for n in names}

    def _tensor(self, name: str) -> Tensor:
        """``name``'s tensor, mapped from its file (opened once)."""
        if name not in self.where:
            raise MissingTensors(self.path, [name])
        file = self.where[name]
        path = self.path / file
        if file not in self._opened:
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as err:
                raise CheckpointDamaged(path, f"torch cannot read it: {err}") from err
            self._opened[file] = loaded
        if name not in self._opened[file]:
            raise CheckpointDamaged(path, f"{name} is not in it")
        return self._opened[file][name]


def shard_files(folder: Path, manifest: dict[str, Any]) -> ShardFiles:
    """The weights of a ``giantpipe-shards/1`` checkpoint directory."""
    return ShardFiles(folder, {n: s["file"] for s in manifest["shards"] for n in s["names"]})


def renamed_tensors(state: Mapping[str, Any]) -> dict[str, Tensor]:
    """A run state's tensors of the optimizer and the EMA under today's names (:data:`RENAMED`).

    >>> sorted(renamed_tensors({"optimizer": {"state": {"w": {"step": 1, "m": torch.ones(1)}}},
    ...                         "ema": {"w": torch.ones(1)}}))
    ['ema/w', 'optimizer/w/m']
    """
    tensors = {
        f"{OPTIMIZER}{name}/{key}": value
        for name, values in ((state.get("optimizer") or {}).get("state") or {}).items()
        for key, value in values.items()
        if isinstance(value, Tensor)
    }
    tensors.update({f"{EMA}{name}": t for name, t in (state.get("ema") or {}).items()})
    return tensors


@dataclass
class EarlierRun:
    """What an earlier format holds of a run, in today's terms: tensors by today's names, and
    the run state of each rank (replica 0's first)."""

    tensors: TensorSource
    states: list[dict[str, Any]]
    leaders: list[int]


def shards_v1_run(folder: Path, manifest: dict[str, Any], extra: dict[str, Any]) -> EarlierRun:
    """A run's ``giantpipe-shards/1`` checkpoint: weights in per-rank files, the optimizer's and
    the EMA's tensors inside each leader's run-state file."""
    states = [safe_load(folder / name, mmap=True) for name in extra["state_files"]]
    leaders = list(extra["leader_ranks"])
    held = {k: v for r in leaders for k, v in renamed_tensors(states[r]).items()}
    source = Chained(folder, [shard_files(folder, manifest), HeldTensors(folder, held)])
    return EarlierRun(source, states, leaders)


def one_file(path: Path) -> tuple[dict[str, Any], EarlierRun]:
    """A ``last.pt`` of the earlier format: its fields (step, position, balance, EMA or not)
    and the run in today's terms; CheckpointError if it is none."""
    state = safe_load(path, mmap=True)
    if not isinstance(state, dict) or any(k not in state for k in ONE_FILE_KEYS):
        raise CheckpointError(path, "is not a giantpipe checkpoint")
    held = {**state["model"], **renamed_tensors(state)}
    fields = {
        "step": int(state["step"]),
        "position": int(state["position"]),
        "balance": list(state.get("balance") or []),
        "ema": state.get("ema") is not None,
        "weights": list(state["model"]),
    }
    return fields, EarlierRun(HeldTensors(path, held), [state], [0])
