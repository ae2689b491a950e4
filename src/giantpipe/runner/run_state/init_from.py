"""Fine-tuning: start a run from another run's weights (``trainer.init_from=PATH``).

The GPipe paper's transfer experiments start from the ImageNet model and replace its softmax for
the new data set's classes. Here every tensor of the checkpoint whose name and shape match the
new model is loaded; the rest (the classifier of another class count) keep the fresh
initialization the builder gave them. The optimizer, the learning-rate schedule, the step and
the data position start anew: this is a new run, not a resume. PATH is a checkpoint directory
(its EMA of the weights when it kept one, with the model's buffers), a shard directory of
``DistributedPipe.save_checkpoint``, a ``.pt`` checkpoint of the earlier format, or a plain
``state_dict`` file. Under torchrun each rank loads its own stage's tensors.

Example::

    python train.py recipe=amoebanet_quickstart trainer.max_steps=100        # writes last/
    python train.py recipe=amoebanet_quickstart trainer.init_from=outputs/.../last \\
        data.num_classes=5
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from giantpipe.checkpoint.load import load
from giantpipe.checkpoint.manifest import read_manifest
from giantpipe.checkpoint.names import MANIFEST
from giantpipe.checkpoint.run import RUN_FORMAT, read_checkpoint
from giantpipe.checkpoint.unpickling import safe_load
from giantpipe.config import ConfigError
from giantpipe.runner.run_state.refusal import refusing

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment

log = logging.getLogger(__name__)
INIT = "trainer.init_from"


def read_weights(path: Path) -> dict[str, Tensor]:
    """Name -> tensor from a checkpoint (its EMA when it kept one), a shard directory or a
    plain ``state_dict`` file; anything else is a ConfigError naming trainer.init_from.

    Example::

        weights = read_weights(Path("outputs/2026-11-30/14-26-42/last"))
    """
    if path.is_dir():
        if not (path / MANIFEST).is_file():
            raise ConfigError(INIT, f"no checkpoint ({MANIFEST}) in {path}")
        with refusing(path, INIT):
            extra = read_manifest(path).get("extra") or {}
            if extra.get("format") == RUN_FORMAT:
                state = read_checkpoint(path)
                return {**state["model"], **(state["ema"] or {})}
            return load(path)
    if not path.is_file():
        raise ConfigError(INIT, f"no checkpoint at {path}")
    with refusing(path, INIT):
        loaded: Any = safe_load(path)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
        weights = dict(loaded["model"])
        if isinstance(loaded.get("ema"), Mapping):
            weights.update(loaded["ema"])
        loaded = weights
    if not isinstance(loaded, Mapping) or not loaded:
        raise ConfigError(INIT, f"{path} holds no state dict (a name -> tensor mapping)")
    return {str(k): v for k, v in loaded.items() if isinstance(v, Tensor)}


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

    The GPipe paper's transfer experiments start from the ImageNet model and replace its
    softmax: every tensor whose name and shape match is loaded, the rest (a classifier of
    another class count) keep their fresh initialization; optimizer, step and data position
    start anew. A one-line ConfigError when nothing matches (another model, or a path to the
    wrong run). The EMA, if any, restarts from the loaded weights.
    """
    live = parts.pipe.state_dict()
    saved = read_weights(path)
    found = matching(saved, live)
    if not found:
        raise ConfigError(
            INIT,
            f"{path} has no tensor matching this model by name and shape (checkpoint: "
            f"{sorted(saved)[:2]}..., model: {sorted(live)[:2]}...)",
        )
    parts.pipe.load_state_dict({**live, **found})
    if parts.ema is not None:
        parts.ema.load_state_dict({n: p.detach() for n, p in parts.names.items()})
    fresh = sorted(set(live) - set(found))
    log.info(
        "init_from %s: loaded %d of %d tensors; freshly initialized: %s",
        path,
        len(found),
        len(live),
        ", ".join(fresh) if fresh else "none",
    )
    return fresh
