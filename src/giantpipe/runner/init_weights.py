"""Fine-tuning: start a run from another run's weights (``trainer.init_from=PATH``).

The GPipe paper's transfer experiments start from the ImageNet model and replace its softmax for
the new data set's classes. Here every tensor of the checkpoint whose name and shape match the
new model is loaded; the rest (the classifier of another class count) keep the fresh
initialization the builder gave them. The optimizer, the learning-rate schedule, the step and
the data position start anew: this is a new run, not a resume.

When the checkpoint kept an EMA of the weights, its averaged parameters are loaded (they are
the weights the run evaluated and reported), with the buffers (BatchNorm statistics) of the
model.

Example::

    python train.py recipe=amoebanet_quickstart trainer.max_steps=100        # writes last.pt
    python train.py recipe=amoebanet_quickstart trainer.init_from=outputs/.../last.pt \\
        data.num_classes=5
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from giantpipe.config import ConfigError
from giantpipe.runner.build import Experiment
from giantpipe.runner.ema import WeightEMA

log = logging.getLogger(__name__)
KEY = "trainer.init_from"


def read_weights(path: Path) -> dict[str, Tensor]:
    """Name -> tensor from a giantpipe checkpoint (EMA parameters preferred) or a plain
    ``state_dict`` file; anything else is a ConfigError naming trainer.init_from.

    Example::

        weights = read_weights(Path("outputs/2026-11-30/14-26-42/last.pt"))
    """
    if not path.is_file():
        raise ConfigError(KEY, f"no checkpoint at {path}")
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file: say which one
        raise ConfigError(KEY, f"{path} is not a readable checkpoint ({err})") from err
    if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
        weights = dict(state["model"])
        if isinstance(state.get("ema"), Mapping):
            weights.update(state["ema"])
        state = weights
    if not isinstance(state, Mapping) or not state:
        raise ConfigError(KEY, f"{path} holds no state dict (a name -> tensor mapping)")
    return {str(k): v for k, v in state.items() if isinstance(v, Tensor)}


def matching(saved: Mapping[str, Tensor], live: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The saved tensors whose name and shape the live model has.

    Example::

        matching({"fc.weight": torch.zeros(1000, 64)}, {"fc.weight": torch.zeros(10, 64)})  # {}
    """
    return {
        name: tensor
        for name, tensor in saved.items()
        if name in live and tuple(live[name].shape) == tuple(tensor.shape)
    }


def load_initial_weights(parts: Experiment, path: Path) -> list[str]:
    """Load the matching tensors of ``path`` into the built run; return the names left fresh.

    Raises a one-line ConfigError when nothing matches (another model, or a typo in the path
    pointing at the wrong run). The EMA, if any, restarts from the loaded weights.
    """
    live = parts.pipe.state_dict()
    saved = read_weights(path)
    found = matching(saved, live)
    if not found:
        raise ConfigError(
            KEY,
            f"{path} has no tensor matching this model by name and shape (checkpoint: "
            f"{sorted(saved)[:2]}..., model: {sorted(live)[:2]}...)",
        )
    parts.pipe.load_state_dict({**live, **found})
    if parts.ema is not None:
        parts.ema = WeightEMA(parts.names, parts.ema.decay)
    fresh = sorted(set(live) - set(found))
    log.info(
        "init_from %s: loaded %d of %d tensors; freshly initialized: %s",
        path,
        len(found),
        len(live),
        ", ".join(fresh) if fresh else "none",
    )
    return fresh
