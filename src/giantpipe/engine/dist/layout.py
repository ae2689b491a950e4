"""Who is who in a pipeline x data-parallel world: ranks, stages, replicas and their groups.

World size = W workers (pipeline ranks) x R replicas. Ranks of one pipeline are neighbours, so
a node holds whole pipelines (or whole slices of one) and the chatty point-to-point traffic
stays on the fastest links; the gradient all-reduce of a stage runs across replicas::

    W=2, R=2        worker 0 (stage 0)   worker 1 (stage 1)
    replica 0       rank 0               rank 1             <- pipeline group
    replica 1       rank 2               rank 3
                      ^ replica group of stage 0 (all-reduce of its gradients)

With V virtual stages per worker (interleaved schedules) worker w holds stages w, w+W, ...
(``Schedule.placement``). Data: stage 0's ranks read inputs, the last stage's ranks read
targets, sharded by ``replica`` over ``replicas`` (e.g. ``DistributedSampler(data,
num_replicas=layout.replicas, rank=layout.replica)``); the other ranks read nothing.

Example::

    >>> layout = Layout(world_size=4, rank=3, workers=2, placement=(0, 1))
    >>> layout.replica, layout.worker, layout.local_stages, layout.rank_of_stage(0)
    (1, 1, [1], 2)
    >>> layout.needs_inputs, layout.needs_targets
    (False, True)
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """The position of one rank in a W x R world, given the schedule's stage placement."""

    world_size: int
    rank: int
    workers: int
    placement: tuple[int, ...]  # stage -> worker
    replicas: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size % self.workers:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of the {self.workers} pipeline "
                "ranks the schedule needs (world size = pipeline ranks x replicas)"
            )
        object.__setattr__(self, "replicas", self.world_size // self.workers)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def replica(self) -> int:
        return self.rank // self.workers

    @property
    def worker(self) -> int:
        return self.rank % self.workers

    @property
    def local_stages(self) -> list[int]:
        return [s for s, w in enumerate(self.placement) if w == self.worker]

    def rank_of_stage(self, stage: int) -> int:
        """The global rank holding ``stage`` in this rank's replica."""
        return self.replica * self.workers + self.placement[stage]

    @property
    def pipeline_ranks(self) -> list[int]:
        return [self.replica * self.workers + w for w in range(self.workers)]

    @property
    def replica_ranks(self) -> list[int]:
        return [r * self.workers + self.worker for r in range(self.replicas)]

    @property
    def needs_inputs(self) -> bool:
        return 0 in self.local_stages

    @property
    def needs_targets(self) -> bool:
        return self.num_stages - 1 in self.local_stages

    def label(self, stage: int | None = None) -> str:
        """``"rank 3 (stage 1)"``: how messages name this rank (or the holder of ``stage``)."""
        if stage is None:
            return self.rank_label(self.rank)
        return f"rank {self.rank_of_stage(stage)} (stage {stage})"

    def rank_label(self, rank: int) -> str:
        """``"rank 3 (stage 1)"`` for any rank of the world (``"(stages 1, 3)"`` with V > 1)."""
        stages = [s for s, w in enumerate(self.placement) if w == rank % self.workers]
        word = "stage" if len(stages) == 1 else "stages"
        return f"rank {rank} ({word} {', '.join(map(str, stages))})"


@dataclass(frozen=True)
class Groups:
    """Process groups of one rank: p2p traffic, its pipeline, its stage's replicas."""

    p2p: Any  # every rank; boundary activations and gradients
    pipeline: Any  # this rank's pipeline: loss and statistics
    replica: Any  # this rank's stage across replicas: gradient all-reduce (None when R = 1)


_CACHE: dict[tuple[int, int, float], tuple[Any, list[Any]]] = {}


def build_groups(layout: Layout, timeout: float) -> Groups:
    """Creates (once per world shape) every group; all ranks must call it in the same order.

    Groups are cached per default process group: a second pipeline of the same shape reuses
    them (creating a gloo group connects every pair of its ranks, which takes a while).
    """
    key = (layout.world_size, layout.workers, timeout)
    world = dist.distributed_c10d._get_default_group()  # noqa: SLF001 - identity of the world
    if key not in _CACHE or _CACHE[key][0] is not world:
        delta = datetime.timedelta(seconds=timeout)
        w, r = layout.workers, layout.replicas
        made = [dist.new_group(list(range(layout.world_size)), timeout=delta)]
        made += [dist.new_group([q * w + i for i in range(w)], timeout=delta) for q in range(r)]
        made += [dist.new_group([q * w + i for q in range(r)], timeout=delta) for i in range(w)]
        _CACHE[key] = (world, made)
    groups = _CACHE[key][1]
    return Groups(
        p2p=groups[0],
        pipeline=groups[1 + layout.replica],
        replica=groups[1 + layout.replicas + layout.worker] if layout.replicas > 1 else None,
    )


def tied_group(layout: Layout, workers: Sequence[int], timeout: float) -> Any:
    """The group of this replica's ``workers`` (pipeline ranks holding one tied parameter);
    every rank creates every replica's group, in the same order, as ``new_group`` requires.

    >>> tied_group(layout, [0, 3], 60.0)   # ranks 0 and 3 of replica 0, 4 and 7 of replica 1
    """
    key = (layout.world_size, layout.workers, timeout, tuple(workers))
    world = dist.distributed_c10d._get_default_group()  # noqa: SLF001 - identity of the world
    if key not in _TIED or _TIED[key][0] is not world:
        delta = datetime.timedelta(seconds=timeout)
        w = layout.workers
        made = [
            dist.new_group([q * w + i for i in workers], timeout=delta)
            for q in range(layout.replicas)
        ]
        _TIED[key] = (world, made)
    return _TIED[key][1][layout.replica]


_TIED: dict[tuple[int, int, float, tuple[int, ...]], tuple[Any, list[Any]]] = {}


def drop_groups(groups: Groups) -> None:
    """Destroys this rank's groups after a failure: closing the connections wakes the peers."""
    for key, (_, made) in list(_CACHE.items()):
        if groups.p2p in made:
            del _CACHE[key]
    tied = [g for key in list(_TIED) for g in _TIED.pop(key)[1]]  # connections of the same world
    for group in (groups.p2p, groups.pipeline, groups.replica, *tied):
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001, S110 - already gone with the world
                pass


def init_distributed(backend: str | None = None, timeout: float = 60.0) -> None:
    """Initialises the default process group from torchrun's environment, if not done yet.

    NCCL where CUDA is available, gloo otherwise (CPU; also what the tests use on loopback).
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def comm_device(device: torch.device) -> torch.device:
    """Where boundary bytes travel from: the device with NCCL, host memory with gloo."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")
