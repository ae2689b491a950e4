"""Fine-tuning: a run started from another's weights (``trainer.init_from=PATH``), each process
reading only the tensors of the stages it holds, from anything
:func:`giantpipe.checkpoint.weights.open_weights` reads (docs/checkpoints.md#starting-from-weights).
Every tensor whose name and shape match is loaded, the rest keep their fresh initialization;
optimizer, schedule, step and data position start anew: a new run, not a resume.

Example::

    python train.py recipe=amoebanet_quickstart trainer.max_steps=100        # writes last/
    python train.py recipe=amoebanet_quickstart trainer.init_from=outputs/.../last \\
        data.num_classes=5
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor, nn

from giantpipe.checkpoint.sources import TensorSource
from giantpipe.checkpoint.weights import open_weights
from giantpipe.config import ConfigError
from giantpipe.runner.run_state.refusal import refusing

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment

log = logging.getLogger(__name__)
INIT = "trainer.init_from"


def read_weights(path: Path) -> dict[str, Tensor]:
    """Every weight at ``path`` by name (:func:`giantpipe.checkpoint.weights.open_weights`); a
    path it cannot read is a ConfigError naming trainer.init_from.

    Example::

        weights = read_weights(Path("outputs/2026-11-30/14-26-42/last"))
    """
    with refusing(path, INIT):
        source = open_weights(path)
        return source.read(source.names())


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


def stage_names(pipe: nn.Module) -> dict[int, list[str]]:
    """The names of each stage's tensors this process holds (by identity with its partitions).

    Example::

        stage_names(GPipe(model, balance=[2, 1]))   # {0: ["0.weight", ...], 1: ["2.weight", ...]}
    """
    owner: dict[int, int] = {}
    for stage, partition in enumerate(getattr(pipe, "partitions", [])):
        for tensor in partition.state_dict(keep_vars=True).values():
            owner.setdefault(id(tensor), stage)
    stages: dict[int, list[str]] = {}
    for name, tensor in pipe.state_dict(keep_vars=True).items():
        if id(tensor) in owner:
            stages.setdefault(owner[id(tensor)], []).append(name)
    return stages


def read_share(
    path: Path, live: Mapping[str, Tensor], stages: Mapping[int, list[str]]
) -> dict[str, Tensor]:
    """The tensors of ``path`` that match ``live`` (this process's) by name and shape, and only
    those read (an FSDP2 shard only its part where ``path`` is a giantpipe checkpoint). A
    one-line ConfigError naming trainer.init_from when nothing matches, or when ``path`` holds
    none of a stage's tensors (``stages``: its names): the wrong file, or one cut short.
    """
    with refusing(path, INIT):
        source = open_weights(path)
        held = set(source.names())
        fitting = [n for n in live if n in held and _fits(source, n, live[n])]
        if not fitting:
            raise ConfigError(
                INIT,
                f"{path} has no tensor matching this model by name and shape (it holds: "
                f"{sorted(held)[:2]}..., the model: {sorted(live)[:2]}...)",
            )
        for stage, names in sorted(stages.items()):
            if names and not any(n in held for n in names):
                shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                raise ConfigError(INIT, f"{path} has no tensor of stage {stage} ({shown})")
        return source.read(fitting, like=live)


def _fits(source: TensorSource, name: str, live: Tensor) -> bool:
    return tuple(source.layout(name).shape) == tuple(live.shape)


def load_initial_weights(parts: Experiment, path: Path) -> list[str]:
    """Load the matching tensors of ``path`` into the built run, reading only this process's
    (:func:`read_share`); return the names left fresh.

    The GPipe paper's transfer experiments start from the ImageNet model and replace its
    softmax: every tensor whose name and shape match is loaded, the rest (a classifier of
    another class count) keep their fresh initialization; optimizer, step and data position
    start anew. The EMA, if any, restarts from the loaded weights.
    """
    live = parts.pipe.state_dict()
    found = read_share(path, live, stage_names(parts.pipe))
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
