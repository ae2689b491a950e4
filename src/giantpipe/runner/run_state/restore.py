"""Restoring: a checkpoint's weights, optimizer, EMA, LR schedule, loss scale and RNG into the
built parts, under any K, R, replica sharding or executor, from a checkpoint of any format
(:func:`giantpipe.checkpoint.run.open_run`); every rank reads only its own names, and an FSDP2
shard only its own part.

Example::

    progress = restore(parts, run_dir / "last", world)      # any K, R or executor
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from giantpipe.checkpoint.errors import MissingTensors
from giantpipe.checkpoint.names import EMA, OPTIMIZER
from giantpipe.checkpoint.run import RunCheckpoint, open_run
from giantpipe.config import ConfigError
from giantpipe.runner.run_state.refusal import refusing
from giantpipe.runner.run_state.state import (
    RESUME,
    Progress,
    check_model_fits,
    load_optimizer_state_by_name,
)
from giantpipe.runner.seeding import restore_rng

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment
    from giantpipe.runner.world import World


def restore(parts: Experiment, path: Path, world: World) -> Progress:
    """Load a checkpoint (a directory, or a ``last.pt`` of the earlier format) into the built
    parts; ConfigError naming trainer.resume if it does not fit or a file is damaged."""
    with refusing(path, RESUME):
        run = open_run(path)
        return restore_run(parts, run, world.rank, whole=world.size == 1)


def restore_run(parts: Experiment, run: RunCheckpoint, rank: int, whole: bool) -> Progress:
    """Weights, optimizer, EMA, LR schedule and RNG for this process's names (any layout);
    ``whole``: this process holds the whole model, so the checkpoint may hold no other name."""
    live = parts.pipe.state_dict()
    if parts.ema is not None and not run.ema:
        raise ConfigError("trainer.ema_decay", f"{run.path} was saved without an EMA")
    wanted = list(live)
    like: dict[str, Tensor] = dict(live)  # where a name lands (an FSDP2 shard: only its part)
    mine = {f"{OPTIMIZER}{n}/" for n in parts.names}
    held = run.tensors.names()
    states = [k for k in held if k.startswith(OPTIMIZER) and k.rsplit("/", 1)[0] + "/" in mine]
    wanted += states
    # a state shaped like its parameter (momentum, Adam's moments) is sharded like it
    like.update({k: parts.names[k[len(OPTIMIZER) :].rsplit("/", 1)[0]] for k in states})
    shadow = parts.ema.shadow if parts.ema is not None else {}
    wanted += [f"{EMA}{n}" for n in shadow]
    like.update({f"{EMA}{n}": t for n, t in shadow.items()})
    try:
        loaded = run.tensors.read(wanted, like)
    except MissingTensors as err:
        raise ConfigError(RESUME, f"{run.path} does not fit this model ({err})") from err
    others = [n for n in run.weights if n not in live] if whole else []
    check_model_fits({n: loaded[n] for n in live}, live, run.path, others)
    leaders = run.leader_states()
    _restore_optimizer(parts, leaders, run.path, loaded)
    parts.pipe.load_state_dict({n: loaded[n] for n in live})
    if parts.ema is not None:
        ema = {n[len(EMA) :]: t for n, t in loaded.items() if n.startswith(EMA)}
        parts.ema.load_state_dict({n: t for n, t in ema.items() if n in parts.ema.shadow})
    parts.scheduler.load_state_dict(leaders[0]["scheduler"])
    _restore_grad_scaler(parts, leaders[0])
    if rank < run.ranks:  # a rank new to the layout keeps its seeded generators
        restore_rng(run.state_of(rank)["rng"])
    return Progress(step=run.step, position=run.position, window=run.window)


def _restore_grad_scaler(parts: Experiment, state: dict[str, Any]) -> None:
    """fp16: the saved loss scale, where the run saved one (a run saved in fp32 or bf16, or
    before scalers were saved, starts from the scaler's initial scale)."""
    saved = state.get("grad_scaler")
    if parts.grad_scaler is not None and saved is not None:
        parts.grad_scaler.load_state_dict(saved)


def _restore_optimizer(
    parts: Experiment, leaders: list[dict[str, Any]], directory: Path, tensors: dict[str, Tensor]
) -> None:
    """This process's optimizer state, gathered by parameter name from the leaders' run states
    (values other than tensors, parameter groups) and from ``tensors`` (``optimizer/NAME/KEY``)."""
    mine = set(parts.names)
    per_name = {
        name: {k: v for k, v in value.items() if not isinstance(v, Tensor)}
        for s in leaders
        for name, value in s["optimizer"]["state"].items()
        if name in mine
    }
    for key, tensor in tensors.items():
        if key.startswith(OPTIMIZER):
            name, slot = key[len(OPTIMIZER) :].rsplit("/", 1)
            per_name.setdefault(name, {})[slot] = tensor
    saved_groups = leaders[0]["optimizer"]["param_groups"]
    live_groups = [
        [n for n, p in parts.names.items() if any(p is q for q in g["params"])]
        for g in parts.optimizer.param_groups
    ]
    if len(saved_groups) != len(live_groups):
        raise ConfigError(RESUME, f"{directory}: optimizer parameter groups differ")
    state = {
        "state": per_name,
        "param_groups": [
            {**saved, "params": names}
            for saved, names in zip(saved_groups, live_groups, strict=True)
        ],
    }
    try:
        load_optimizer_state_by_name(parts.optimizer, state, parts.names)
    except (ValueError, KeyError) as err:
        raise ConfigError(RESUME, f"{directory}: optimizer state does not fit ({err})") from err
