"""Staging a save: what one save of this process holds (its tensors and run state), then
written in the checkpoint format (:func:`giantpipe.checkpoint.save.save_collective`).

Every rank writes its run state (LR schedule, fp16's loss scale, RNG, the optimizer's other
values), replica 0's ranks the tensors (weights, optimizer, EMA; with the stages on FSDP2,
every rank its own shards of them, gathered nowhere), and rank 0 commits the save. Staging
copies the tensors to host memory first when the write runs in the background
(:mod:`giantpipe.runner.run_state.writer`).

Example::

    save_run(parts, progress, run_dir / "last", world)      # every rank
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from giantpipe.checkpoint.names import EMA, OPTIMIZER, new_token, state_file
from giantpipe.checkpoint.run import RUN_FORMAT
from giantpipe.checkpoint.save import replica_share, save_collective
from giantpipe.engine.distributed.replicas import local_tensor
from giantpipe.runner.run_state.state import Progress, optimizer_state_by_name
from giantpipe.runner.seeding import rng_state

if TYPE_CHECKING:
    from giantpipe.runner.build import Experiment
    from giantpipe.runner.world import World


@dataclass(frozen=True)
class Place:
    """Where this process sits: its rank, its replica, the stages it holds, K, R, placement."""

    rank: int
    replica: int
    stages: list[int]
    workers: int
    replicas: int
    placement: list[int]


def place_of(pipe: Any) -> Place:
    """The place of ``pipe``'s process (a GPipe holds every stage, in a world of one)."""
    layout = getattr(pipe, "layout", None)
    if layout is None:
        stages = list(range(len(pipe.partitions)))
        return Place(0, 0, stages, pipe.num_workers, 1, list(pipe.placement))
    return Place(
        layout.rank,
        layout.replica,
        layout.local_stages,
        layout.workers,
        layout.replicas,
        list(layout.placement),
    )


@dataclass
class Staged:
    """One save of this process, ready to write: tensors for DCP (copies in host memory when
    the write runs in the background), the run state, rank 0's manifest fields."""

    step: int
    token: str
    tensors: dict[str, Tensor]
    state: dict[str, Any]
    entry: dict[str, Any] | None
    """This rank's manifest entry (stages, weight names); None on replicas other than 0."""
    commit_as: tuple[dict[str, Any], dict[str, Any]] | None
    """Rank 0: the manifest's layout fields and its run entry (``extra``)."""


def split_optimizer(
    optimizer: torch.optim.Optimizer, names: Mapping[str, nn.Parameter]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The name-keyed optimizer state as DCP tensors (``optimizer/NAME/KEY``) and the rest
    (other values per name, parameter groups), which the run-state file holds."""
    by_name = optimizer_state_by_name(optimizer, names)
    tensors: dict[str, Tensor] = {}
    rest: dict[str, dict[str, Any]] = {}
    for name, values in by_name["state"].items():
        rest[name] = {}
        for key, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"{OPTIMIZER}{name}/{key}"] = value
            else:
                rest[name][key] = value
    return tensors, {"state": rest, "param_groups": by_name["param_groups"]}


def stage(
    parts: Experiment,
    progress: Progress,
    world: World,
    about: dict[str, Any],
    buffers: dict[str, Tensor] | None = None,
    copied: dict[str, Tensor] | None = None,
) -> Staged:
    """Collective (the save's name comes from rank 0): what this process saves. ``buffers``:
    copy every tensor into these host buffers (the step may change the live ones during the
    write); ``copied``: such a copy made earlier in the same step (only a step changes them)."""
    pipe, place = parts.pipe, place_of(parts.pipe)
    token = world.from_rank0(new_token(progress.step))
    leader = place.replica == 0  # replicas hold the same weights, optimizer state and EMA,
    sharded = getattr(pipe, "shards", None) is not None  # or each its FSDP2 shards of them
    tensors: dict[str, Tensor] = {}
    optimizer, entry = None, None
    if leader or sharded:
        weights = pipe.state_dict()
        opt_tensors, optimizer = split_optimizer(parts.optimizer, parts.names)
        tensors.update({**weights, **opt_tensors})
        if parts.ema is not None:
            tensors.update({f"{EMA}{n}": t for n, t in parts.ema.state_dict().items()})
        tensors = replica_share(tensors, place.replica)
        if leader:
            entry = {"rank": place.rank, "stages": list(place.stages), "names": list(weights)}
        else:
            optimizer = None  # its other values: the leaders' files hold them
    state = {
        "rank": place.rank,
        "step": progress.step,
        "position": progress.position,
        "scheduler": parts.scheduler.state_dict(),
        "rng": rng_state(),
        "optimizer": optimizer,
        "ema": None,  # its tensors are DCP's
        # fp16: the loss scale and its growth count, the same on every rank (one verdict)
        "grad_scaler": parts.grad_scaler.state_dict() if parts.grad_scaler is not None else None,
    }
    if copied is not None:
        tensors = copied
    elif buffers is not None:
        tensors = copy_to_host(tensors, buffers)
    else:
        tensors = {k: to_host(t.detach()) for k, t in tensors.items()}
    if buffers is not None or copied is not None:
        state = copy.deepcopy(state)
    commit_as = None
    if world.rank == 0:
        commit_as = (_layout(pipe, place, progress.step), _run_entry(parts, progress, world, token))
        commit_as[1]["model"] = about
    return Staged(progress.step, token, tensors, state, entry, commit_as)


def _layout(pipe: Any, place: Place, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "balance": list(pipe.balance),
        "schedule": pipe.schedule,
        "chunks": pipe.chunks,
        "workers": place.workers,
        "replicas": place.replicas,
        "placement": place.placement,
    }


def _run_entry(parts: Experiment, progress: Progress, world: World, token: str) -> dict[str, Any]:
    replicas = place_of(parts.pipe).replicas
    return {
        "format": RUN_FORMAT,
        "step": progress.step,
        "position": progress.position,
        "window": progress.window,
        "state_files": [f"{token}/{state_file(r)}" for r in range(world.size)],
        "leader_ranks": list(range(world.size // replicas)),  # replica 0's ranks
        "ema": parts.ema is not None,
    }


def copy_to_host(tensors: dict[str, Tensor], buffers: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` copied into ``buffers`` (host memory, kept from save to save: a fresh 1 GiB
    costs the kernel a quarter of a million page faults every time, here slower than the copy;
    pinned for a GPU's tensors, so the copies run asynchronously and at full speed)."""
    copies: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        local = local_tensor(tensor.detach())  # an FSDP2 shard: only this rank's part
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
            buffers[name] = buffer
        buffer.copy_(local, non_blocking=local.is_cuda)
        copies[name] = as_held_by(buffer, tensor)
    for name in set(buffers) - set(tensors):
        del buffers[name]
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()  # the copies are done before the step changes the tensors
    return copies


def to_host(tensor: Tensor) -> Tensor:
    """``tensor`` in host memory: an FSDP2 shard stays a shard (its local part copied).

    >>> to_host(torch.ones(2)).device.type
    'cpu'
    """
    return as_held_by(local_tensor(tensor).cpu(), tensor)


def as_held_by(local: Tensor, tensor: Tensor) -> Tensor:
    """``local`` (a copy of ``tensor``'s local part) as the part of the same whole tensor,
    for DCP: a DTensor like ``tensor`` where ``tensor`` is one, else ``local``."""
    if not isinstance(tensor, DTensor):
        return local
    return DTensor.from_local(
        local,
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )


def write_staged(staged: Staged, directory: Path, group: Any) -> None:
    """Collective over ``group`` (None: one process): writes ``staged`` into ``directory``
    and commits it there (rank 0)."""
    rank = staged.state["rank"]
    objects = {state_file(rank): staged.state}
    directory.mkdir(parents=True, exist_ok=True)
    save_collective(
        directory, staged.token, staged.tensors, objects, staged.entry, staged.commit_as, group
    )


def host_group(pipe: Any, world: World) -> Any:
    """The gloo group of every rank that saves run on (None in a world of one)."""
    return pipe.groups.control if world.size > 1 else None


def save_run(
    parts: Experiment,
    progress: Progress,
    directory: Path,
    world: World,
    about: dict[str, Any] | None = None,
) -> None:
    """Collective: every rank writes its run state, replica 0 its tensors; rank 0 commits.
    ``about``: what the manifest says of the model
    (:func:`giantpipe.runner.run_state.model_record.model_record`)."""
    staged = stage(parts, progress, world, about or {})
    write_staged(staged, directory, host_group(parts.pipe, world))
