"""A run's state by name: where the run is (:class:`Progress`), the format's names and prefixes,
and the optimizer's state keyed by parameter name, checked against the live model.

Optimizer and EMA state are keyed by parameter NAME, not by position, so a run resumes under
another K, R or executor: every rank takes its own names from whichever files hold them.

Example::

    state = optimizer_state_by_name(optimizer, parameter_names(pipe))
    load_optimizer_state_by_name(other_optimizer, state, parameter_names(other_pipe))
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from giantpipe.config import ConfigError
from giantpipe.engine.distributed.replicas import shard_like

RESUME = "trainer.resume"


@dataclass
class Progress:
    """Where the run is: optimizer steps done and training batches consumed."""

    step: int = 0
    position: int = 0
    window: dict[str, Any] | None = None
    """The metrics' logging window a save cut (giantpipe.metrics.step.Window.state), which a
    resumed run goes on with; None: empty."""


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
    # A whole state for a parameter held as an FSDP2 shard (a checkpoint of the earlier
    # format): this rank's shard of it, as the parameter (torch's optimizers keep the state's
    # type as it is loaded).
    per_name = {
        n: {k: _as_param(v, names[n]) for k, v in values.items()}
        for n, values in state["state"].items()
    }
    optimizer.load_state_dict(
        {
            "state": {index_of[n]: s for n, s in per_name.items()},
            "param_groups": [
                {**saved, "params": [index_of[n] for n in live]}
                for saved, live in zip(saved_groups, live_groups, strict=True)
            ],
        }
    )


def _as_param(value: Any, param: Tensor) -> Any:
    """An optimizer state value as ``param`` holds it: a whole tensor shaped like an FSDP2
    parameter becomes this rank's shard
    (:func:`giantpipe.engine.distributed.replicas.shard_like`)."""
    if isinstance(value, Tensor) and tuple(value.shape) == tuple(param.shape) and value.dim():
        return shard_like(value, param)
    return value


def check_model_fits(
    saved: Mapping[str, Tensor],
    live: Mapping[str, Tensor],
    path: Path,
    others: Collection[str] = (),
) -> None:
    """Raise a one-line ConfigError unless the saved weights have this model's names and shapes;
    ``others``: names the checkpoint holds besides ``saved`` (none may be left over)."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted((set(saved) | set(others)) - set(live))
    if missing or unexpected:
        raise ConfigError(
            RESUME,
            f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}",
        )
    for name, tensor in live.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            raise ConfigError(
                RESUME,
                f"{path} does not fit this model: {name} has shape {tuple(saved[name].shape)} "
                f"in the checkpoint, {tuple(tensor.shape)} here",
            )
