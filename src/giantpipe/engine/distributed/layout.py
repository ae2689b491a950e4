"""Who is who in a pipeline x data-parallel world: ranks, stages, replicas and their groups.

World size = W workers (pipeline ranks) x R replicas, the ranks of one pipeline neighbours; who
reads which data, and the world drawn: docs/engine-internals.md#ranks-stages-and-replicas.

Example::

    >>> layout = Layout(world_size=4, rank=3, workers=2, placement=(0, 1))
    >>> layout.replica, layout.worker, layout.local_stages, layout.rank_of_stage(0)
    (1, 1, [1], 2)
    >>> layout.needs_inputs, layout.needs_targets
    (False, True)
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.distributed.faults import FailureBoard, wait_work


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
    """Process groups of one rank, each with the backend of what it carries.

    Device groups take tensors on the pipe's device (NCCL on CUDA, gloo on CPU); host groups
    take CPU tensors and Python objects (always gloo). On a CPU device the host groups are the
    device groups (the same objects). A collective handed a tensor its group does not serve
    fails ("No backend type associated with device type cpu" for a CPU tensor on NCCL)::

        group          backend      ranks                    carries
        p2p            device       every rank               boundary bytes, the global norm
                                                             with replicas
        control        host         every rank               step starts, descriptions, the
                                                             generation ring, object
                                                             collectives (runner, checkpoint)
        pipeline       device       this rank's pipeline     the global gradient norm (R = 1)
        replica        device       this stage's replicas    FSDP2's mesh (its all-gathers,
                                                             reduces), BatchNorm stats
        host_pipeline  host         this rank's pipeline     step statistics rows, the loss
        host_replica   host         this stage's replicas    loss normaliser, loss sum

    ``replica`` and ``host_replica`` are None when R = 1. Tied parameters have their own device
    groups (:func:`tied_group`).
    """

    p2p: Any
    control: Any
    pipeline: Any
    replica: Any
    host_pipeline: Any
    host_replica: Any

    @classmethod
    def torn_down(cls) -> Groups:
        """No groups: what a pipe holds after a failure destroyed its own."""
        return cls(None, None, None, None, None, None)

    def unique(self) -> list[Any]:
        """Every group once (on CPU the host groups are the device groups), None left out."""
        every = [self.p2p, self.control, self.pipeline, self.replica]
        every += [self.host_pipeline, self.host_replica]
        found = {id(g): g for g in every if g is not None}
        return list(found.values())


HOST_BACKEND = "gloo"
"""The backend of host groups: CPU tensors and pickled objects."""


def device_backend(device: torch.device | str) -> str:
    """The backend of the groups that carry ``device``'s tensors.

    >>> device_backend("cuda:1"), device_backend("cpu")
    ('nccl', 'gloo')
    """
    return "nccl" if torch.device(device).type == "cuda" else HOST_BACKEND


_CACHE: dict[tuple[int, int, float, str], tuple[Any, list[Any], list[Any]]] = {}


def build_groups(layout: Layout, timeout: float, device: torch.device | str) -> Groups:
    """Creates (once per world shape and device kind) every group; all ranks must call it in
    the same order, with the same kind of device.

    Every group names its backend (``device_backend(device)`` or gloo) rather than inheriting
    the world's: a world of ``"cpu:gloo,cuda:nccl"`` would otherwise hand boundary payloads to
    gloo, and an NCCL-only world would refuse every CPU value. Groups are cached per default
    process group: a second pipeline of the same shape reuses them (creating a gloo group
    connects every pair of its ranks, which takes a while).

    Example (on every rank of a ``"cpu:gloo,cuda:nccl"`` world)::

        groups = build_groups(layout, 60.0, torch.device("cuda", 0))
        dist.get_backend(groups.p2p), dist.get_backend(groups.control)   # ('nccl', 'gloo')
    """
    backend = device_backend(device)
    key = (layout.world_size, layout.workers, timeout, backend)
    world = dist.distributed_c10d._get_default_group()  # noqa: SLF001 - identity of the world
    if key not in _CACHE or _CACHE[key][0] is not world:
        if backend == "nccl":
            default_nccl_error_handling()  # read when the NCCL groups are created
        on_device = _new_groups(layout, timeout, backend)
        on_host = on_device
        if backend != HOST_BACKEND:  # on CPU the device groups already carry host values
            on_host = _new_groups(layout, timeout, HOST_BACKEND)
        _CACHE[key] = (world, on_device, on_host)
    _, on_device, on_host = _CACHE[key]
    pipeline, replica = 1 + layout.replica, 1 + layout.replicas + layout.worker
    replicated = layout.replicas > 1
    return Groups(
        p2p=on_device[0],
        control=on_host[0],
        pipeline=on_device[pipeline],
        replica=on_device[replica] if replicated else None,
        host_pipeline=on_host[pipeline],
        host_replica=on_host[replica] if replicated else None,
    )


def _new_groups(layout: Layout, timeout: float, backend: str) -> list[Any]:
    """[the world, each replica's pipeline..., each worker's replicas...] on ``backend``."""
    delta = datetime.timedelta(seconds=timeout)
    w, r = layout.workers, layout.replicas

    def new(ranks: list[int]) -> Any:
        return dist.new_group(ranks, timeout=delta, backend=backend)

    made = [new(list(range(layout.world_size)))]
    made += [new([q * w + i for i in range(w)]) for q in range(r)]
    made += [new([q * w + i for q in range(r)]) for i in range(w)]
    return made


def tied_group(
    layout: Layout, workers: Sequence[int], timeout: float, device: torch.device | str
) -> Any:
    """The device group of this replica's ``workers`` (pipeline ranks holding one tied
    parameter, whose gradients it sums on ``device``); every rank creates every replica's
    group, in the same order, as ``new_group`` requires.

    Example (on every rank of a world of 8: K=4 pipeline ranks x R=2 replicas)::

        tied_group(layout, [0, 3], 60.0, "cpu")  # ranks 0 and 3 of replica 0, 4 and 7 of replica 1
    """
    backend = device_backend(device)
    key = (layout.world_size, layout.workers, timeout, tuple(workers), backend)
    world = dist.distributed_c10d._get_default_group()  # noqa: SLF001 - identity of the world
    if key not in _TIED or _TIED[key][0] is not world:
        delta = datetime.timedelta(seconds=timeout)
        w = layout.workers
        made = [
            dist.new_group([q * w + i for i in workers], timeout=delta, backend=backend)
            for q in range(layout.replicas)
        ]
        _TIED[key] = (world, made)
    return _TIED[key][1][layout.replica]


_TIED: dict[tuple[int, int, float, tuple[int, ...], str], tuple[Any, list[Any]]] = {}


def drop_groups(groups: Groups) -> None:
    """Destroys this rank's groups after a failure: closing the connections wakes the peers."""
    for key, (_, on_device, _) in list(_CACHE.items()):
        if groups.p2p is on_device[0]:
            del _CACHE[key]
    tied = [g for key in list(_TIED) for g in _TIED.pop(key)[1]]  # connections of the same world
    for group in groups.unique() + tied:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001, S110 - already gone with the world
            pass


WARM_UP = 7
"""Tag of the warm-up's messages (apart from the transports' tags; all waited before step 1)."""


@dataclass(frozen=True)
class WarmUp:
    """One operation of the warm-up: an all-reduce over ``ranks`` on a device group (``group``:
    ``"p2p"``, the world's; ``"pipeline"``; ``"replica"``; ``"tied"``), or (``group="pair"``) one
    message from ``ranks[0]`` to ``ranks[1]`` on the p2p group: what makes NCCL create the
    communicator the pair's boundary values travel on."""

    group: str
    ranks: tuple[int, ...]


def tied_workers(
    shared: Sequence[Sequence[tuple[int, str]]], balance: Sequence[int], placement: Sequence[int]
) -> list[tuple[int, ...]]:
    """The pipeline ranks (workers) of each parameter tied across ranks, once each, in the
    order of ``shared`` (``partition.shared_parameters``: the same on every rank).

    >>> tied_workers([[(0, "weight"), (3, "weight")]], balance=[2, 2], placement=[0, 1])
    [(0, 1)]
    """
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    found: list[tuple[int, ...]] = []
    for places in shared:
        workers = tuple(sorted({placement[stage_of[i]] for i, _ in places}))
        if len(workers) > 1 and workers not in found:
            found.append(workers)
    return found


def warm_up_order(layout: Layout, tied: Sequence[tuple[int, ...]] = ()) -> list[WarmUp]:
    """Every device communicator of the world, in the one order every rank derives alike:
    the world's group, each replica's pipeline group, each stage's replica group, each tied
    group, then each pair of pipeline ranks that exchange boundary values, replica by replica.

    NCCL creates a group's communicator at its first operation, a pair's at its first send:
    lazily inside step 1, each creation a collective of its members, while other pairs'
    kernels may already wait on the GPU (NCCL documents deadlocks from concurrent creation).
    :func:`warm_up` creates them all when the pipe is built instead, one at a time; each rank
    runs the operations it is a member of, in this order, so no two ranks wait for each other
    in different orders (a global order filtered per rank cannot deadlock).

    >>> for op in warm_up_order(Layout(4, 0, 2, (0, 1))):
    ...     print(op.group, op.ranks)
    p2p (0, 1, 2, 3)
    pipeline (0, 1)
    pipeline (2, 3)
    replica (0, 2)
    replica (1, 3)
    pair (0, 1)
    pair (2, 3)
    """
    w, r = layout.workers, layout.replicas
    order = [WarmUp("p2p", tuple(range(layout.world_size)))]
    order += [WarmUp("pipeline", tuple(q * w + i for i in range(w))) for q in range(r)]
    if r > 1:
        order += [WarmUp("replica", tuple(q * w + i for q in range(r))) for i in range(w)]
    order += [WarmUp("tied", tuple(q * w + i for i in ws)) for ws in tied for q in range(r)]
    pairs = sorted(
        {(min(a, b), max(a, b)) for a, b in zip(layout.placement, layout.placement[1:]) if a != b}
    )
    order += [WarmUp("pair", (q * w + a, q * w + b)) for q in range(r) for a, b in pairs]
    return order


def warm_up(
    layout: Layout,
    groups: Groups,
    tied: Sequence[tuple[int, ...]],
    device: torch.device,
    timeout: float,
    board: FailureBoard | None = None,
) -> list[WarmUp]:
    """Runs this rank's operations of :func:`warm_up_order` (collective: every rank calls it
    when its pipe is built), each waited on the host under ``timeout`` before the next starts;
    returns them. On gloo (CPU) the same operations run, and cost a few round trips.

    Example (on every rank, right after its groups exist)::

        warm_up(layout, groups, tied_workers(shared, balance, placement), device, 60.0, board)
    """
    done = []
    for op in warm_up_order(layout, tied):
        if layout.rank not in op.ranks:
            continue
        value = torch.zeros(1, device=comm_device(device))
        if op.group == "pair":
            sender = layout.rank == op.ranks[0]
            peer = op.ranks[1] if sender else op.ranks[0]
            call = dist.isend if sender else dist.irecv
            work = call(value, peer, group=groups.p2p, tag=WARM_UP)
            what = f"the warm-up message {'to' if sender else 'from'} {layout.rank_label(peer)}"
        else:
            if op.group == "tied":
                group = tied_group(layout, [i % layout.workers for i in op.ranks], timeout, device)
            else:
                group = getattr(groups, op.group)
            work = dist.all_reduce(value, group=group, async_op=True)
            what = f"the warm-up all-reduce of the {op.group} group over ranks {list(op.ranks)}"
        wait_work(work, timeout, what, board)
        done.append(op)
    return done


def default_nccl_error_handling() -> None:
    """Sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless the user set it (either spelling).

    torch's default (3) lets NCCL's watchdog end the process when a collective outlives its
    group's timeout, without aborting the communicator: the rank dies with a log line, writes
    nothing on the failure board, and its peers can only say it is gone. 2 (clean up only)
    aborts the communicator at that timeout (every NCCL group is made with the pipe's), which
    ends the hung kernels, wakes whatever the host was waiting on behind them (an event, an
    ``.item()``) and makes the next wait on the group raise: the engine's own failure path then
    reports it and names the rank. The variable is read when an NCCL group is created. Set it
    yourself (3) if ``ncclCommAbort`` hangs on your system, the case torch's default avoids.
    """
    if not any(
        v in os.environ for v in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
    ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"


def init_distributed(backend: str | None = None, timeout: float = 60.0) -> None:
    """Initialises the default process group from torchrun's environment, if not done yet.

    With CUDA: this process's GPU is made current first (``cuda:LOCAL_RANK``; else every rank
    would use cuda:0, where NCCL refuses a second rank), and the world serves both kinds of
    tensors (``"cpu:gloo,cuda:nccl"``). Without: gloo (also what the tests use on loopback).
    The pipe's own groups name their backends anyway (:func:`build_groups`).

    Example::

        init_distributed()            # under torchrun
        pipe = DistributedPipe(build_model, balance=[4, 4], chunks=8)
    """
    if dist.is_initialized():
        return
    device = bind_device(resolve_device(None))
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else HOST_BACKEND
    if "nccl" in backend:
        default_nccl_error_handling()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def end_distributed() -> None:
    """Ends what :func:`init_distributed` began: destroys every process group and forgets the
    groups pipes cached (:func:`build_groups`, :func:`tied_group`), so the groups are freed now.
    Left to the interpreter's shutdown, a gloo group freeing a request's tensor on its own thread
    aborts the process ("terminate called without an active exception") after a run that
    succeeded. Release each pipe first (``DistributedPipe.release``).

    Example::

        pipe.release()
        end_distributed()
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    _CACHE.clear()
    _TIED.clear()
    gc.collect()  # a pipe in a reference cycle holds its groups until collected


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or by default ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU. A
    bare ``"cuda"`` is this rank's GPU too (not cuda:0 on every rank).

    >>> resolve_device("cpu"), resolve_device("cuda:1")
    (device(type='cpu'), device(type='cuda', index=1))

    Under torchrun, on the rank with ``LOCAL_RANK=2``, ``resolve_device("cuda")`` is ``cuda:2``.
    """
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device is not None:
        device = torch.device(device)
        return torch.device("cuda", local) if device == torch.device("cuda") else device
    if torch.cuda.is_available():
        return torch.device("cuda", local)
    return torch.device("cpu")


def bind_device(device: torch.device) -> torch.device:
    """Makes a CUDA ``device`` this process's current device; returns it.

    Object collectives, barriers and NCCL's communicators use the current device: left at
    cuda:0 on every rank, two ranks would share one GPU (which NCCL refuses). A no-op on CPU.

    Example::

        device = bind_device(resolve_device(None))   # cuda:LOCAL_RANK, or the CPU
    """
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise RuntimeError(
                f"{device} does not exist: this machine has {count} GPU(s); start at most "
                "one rank per GPU (torchrun --nproc_per_node)"
            )
        torch.cuda.set_device(device)
    return device


def comm_device(device: torch.device) -> torch.device:
    """Where boundary bytes travel from: the device itself when it is CUDA (the device groups
    are NCCL's), host memory otherwise. Decided by the device, not by the world's backend: a
    world of ``"cpu:gloo,cuda:nccl"`` still sends CUDA activations by NCCL.

    >>> comm_device(torch.device("cuda", 1)), comm_device(torch.device("cpu"))
    (device(type='cuda', index=1), device(type='cpu'))
    """
    return device if device.type == "cuda" else torch.device("cpu")
