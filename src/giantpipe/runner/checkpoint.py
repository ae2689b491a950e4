"""Checkpoints that survive a crash mid-write and a change of partitioning.

A checkpoint holds the model (the engine's state_dict: un-partitioned names such as
``"3.0.weight"``), the optimizer state keyed by parameter NAME rather than by position, the
scheduler, the EMA, the step, the data position and the RNG states. Keyed by name, a run saved
with K=2 stages resumes with K=3. Files are written to a temporary file in the same directory,
fsynced and renamed over the old one, so ``last.pt`` is always a whole checkpoint.

Example::

    names = parameter_names(pipe, model)
    save_checkpoint(run_dir / "last.pt", {"optimizer": optimizer_state_by_name(opt, names), ...})
    state = load_checkpoint(run_dir / "last.pt")
    load_optimizer_state_by_name(opt, state["optimizer"], names)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from giantpipe.config import ConfigError

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "step", "position", "model", "optimizer", "rng")


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temp file beside ``path``, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # Persist the rename itself (the directory entry), where the platform allows it.
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def first_names(named: Mapping[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    """One name per parameter: a shared one (e.g. one embedding table for source and target)
    appears once, under its first name, so the optimizer does not update it twice per step.

    Example::

        first_names({"0.src.weight": w, "0.tgt.weight": w})   # {"0.src.weight": w}
    """
    seen: set[int] = set()
    unique: dict[str, nn.Parameter] = {}
    for name, param in named.items():
        if id(param) not in seen:
            seen.add(id(param))
            unique[name] = param
    return unique


def parameter_names(pipe: nn.Module, model: nn.Module) -> dict[str, nn.Parameter]:
    """Un-partitioned name -> parameter, for every parameter the engine trains.

    The engine's ``state_dict(keep_vars=True)`` gives the names; the plain model's
    ``named_parameters()`` is the fallback (the engine moves layers in place, keeping the objects).
    """
    live = {id(p) for p in pipe.parameters()}
    candidates = [
        {k: v for k, v in pipe.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter)},
        dict(model.named_parameters()),
    ]
    for named in candidates:
        if {id(p) for p in named.values()} == live:
            return first_names(named)
    raise RuntimeError("cannot name the engine's parameters; checkpoints need un-partitioned names")


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[str, nn.Parameter]
) -> dict[str, Any]:
    """The optimizer's state_dict with parameter indices replaced by names."""
    name_of = {id(p): n for n, p in names.items()}
    state = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        for index, param in zip(saved["params"], live["params"], strict=True):
            index_to_name[index] = name_of[id(param)]
    return {
        "state": {index_to_name[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [index_to_name[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], names: Mapping[str, nn.Parameter]
) -> None:
    """Load a name-keyed optimizer state into ``optimizer``, whatever the parameter order."""
    name_of = {id(p): n for n, p in names.items()}
    live_groups = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved_groups = state["param_groups"]
    if [sorted(g) for g in live_groups] != [sorted(g["params"]) for g in saved_groups]:
        raise ValueError("optimizer parameters differ from the checkpoint's")
    for saved, live in zip(saved_groups, optimizer.param_groups, strict=True):
        if set(saved) != set(live):  # e.g. an sgd checkpoint (momentum) into adamw (betas)
            raise ValueError(f"optimizer settings {sorted(set(saved) ^ set(live))} differ")
    index_of = {name: i for i, name in enumerate(n for g in live_groups for n in g)}
    optimizer.load_state_dict(
        {
            "state": {index_of[n]: s for n, s in state["state"].items()},
            "param_groups": [
                {**saved, "params": [index_of[n] for n in live]}
                for saved, live in zip(saved_groups, live_groups, strict=True)
            ],
        }
    )


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU; anything unreadable is a ConfigError naming the path."""
    if not path.is_file():
        raise ConfigError("trainer.resume", f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file: say which one
        raise ConfigError("trainer.resume", f"{path} is not a readable checkpoint ({err})") from err
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        raise ConfigError("trainer.resume", f"{path} is not a giantpipe checkpoint")
    return state


def check_model_fits(saved: Mapping[str, Tensor], live: Mapping[str, Tensor], path: Path) -> None:
    """Raise a one-line ConfigError unless the saved weights have this model's names and shapes."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    if missing or unexpected:
        raise ConfigError(
            "trainer.resume",
            f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}",
        )
    for name, tensor in live.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            raise ConfigError(
                "trainer.resume",
                f"{path} does not fit this model: {name} has shape {tuple(saved[name].shape)} "
                f"in the checkpoint, {tuple(tensor.shape)} here",
            )
