"""A stage spread over its R replicas on torch's FSDP2: sharding modes, units, gathers, reduces.

The R ranks holding the same stages form their replica group, the mesh of the stages' FSDP2
units, and ``replica_sharding`` chooses how a stage lives there: ``full`` (``fully_shard``
resharded after forward: ZeRO-3), ``grads`` (``fully_shard`` kept gathered through the step:
ZeRO-2, the default) or ``none`` (torch's ``replicate``). The units, when each mode gathers and
reduces, and what a stage holds: docs/engine-internals.md#replicas-on-fsdp2.

Example (every rank of a K=2 x R=2 world)::

    shards = ReplicaShards(held_stages, groups.replica, torch.device("cpu"), "grads")
    shards.begin(grad=True, split=False)   # the one all-gather per unit (grads)
    ...                                    # the stage's actions, up to its last B (or W)
    shards.reduce([stage])                 # its units' reduce-scatter, then resharded
    shards.finish(grad=True)               # waits for the reduces; every unit sharded
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from giantpipe.engine.executor import StepRun
from giantpipe.engine.schedules.actions import Action, Schedule
from giantpipe.engine.spec import (
    DEFAULT_REPLICA_SHARDING,
    REPLICA_SHARDINGS,
    check_replica_sharding,
)

__all__ = [
    "DEFAULT_REPLICA_SHARDING",
    "GatheredLink",
    "MixedPrecisionPolicy",
    "REPLICA_SHARDINGS",
    "ReplicaShards",
    "last_backwards",
    "local_tensor",
    "mixed_precision_policy",
    "shard_like",
    "units_of",
    "whole_tensor",
]


def mixed_precision_policy(precision: str, device: torch.device | str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a run's precision: on a GPU, ``bf16`` and ``fp16`` gather the
    parameters (and compute) in that type and reduce the gradients in float32; otherwise (fp32,
    or the CPU, where the engine's autocast alone sets the compute type) torch's default,
    parameters and reduce in their own type.

    >>> policy = mixed_precision_policy("bf16", "cuda:0")
    >>> policy.param_dtype, policy.reduce_dtype
    (torch.bfloat16, torch.float32)
    >>> mixed_precision_policy("bf16", "cpu") == MixedPrecisionPolicy()
    True
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None or torch.device(device).type != "cuda":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def units_of(stages: Sequence[nn.Module], per_layer: bool = True) -> list[list[nn.Module]]:
    """The FSDP2 units of ``stages``: each layer holding parameters (``per_layer``), else each
    stage; pieces sharing a parameter (across stages of this rank too) together, in order.

    >>> embed, head = nn.Embedding(5, 2), nn.Linear(2, 5, bias=False)
    >>> head.weight = embed.weight
    >>> stages = [nn.Sequential(embed, nn.ReLU()), nn.Sequential(nn.Linear(2, 2), head)]
    >>> [len(u) for u in units_of(stages)], [len(u) for u in units_of(stages, per_layer=False)]
    ([2, 1], [2])
    """
    pieces = [layer for stage in stages for layer in stage.children()] if per_layer else stages
    unit_of: dict[int, list[nn.Module]] = {}  # id(param) -> its unit
    units: list[list[nn.Module]] = []
    for piece in pieces:
        params = list(piece.parameters())
        if not params:
            continue
        joined = [unit_of[id(p)] for p in params if id(p) in unit_of]
        unit = joined[0] if joined else []
        if not joined:
            units.append(unit)
        for other in joined[1:]:
            if other is not unit:
                unit.extend(m for m in other if all(m is not n for n in unit))
                units.remove(other)
        unit.append(piece)
        for member in unit:
            for p in member.parameters():
                unit_of[id(p)] = unit
    return units


def last_backwards(actions: Sequence[Action]) -> dict[int, int]:
    """For each stage in ``actions`` (one worker's), the index of its last B or W: after it,
    the stage's gradients are complete and its units are reduced.

    >>> last_backwards([Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0), Action("F", 1, 0)])
    {0: 2}
    """
    last: dict[int, int] = {}
    for index, action in enumerate(actions):
        if action.kind in ("B", "W"):
            last[action.stage] = index
    return last


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (the whole tensor if replicated),
    any other tensor itself. No communication.

    >>> local_tensor(torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as ``like`` holds it: this rank's shard as a DTensor of
    ``like``'s mesh and placements when ``like`` is a DTensor and ``value`` is not (sliced
    here, no communication), else ``value`` itself.

    >>> shard_like(torch.ones(2), torch.zeros(2)).tolist()
    [1.0, 1.0]
    """
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    return distribute_tensor(
        value.to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s whole value: a DTensor's shards gathered (a collective over its mesh, every
    rank of it calls this in the same order), any other tensor itself.

    >>> whole_tensor(torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class ReplicaShards:
    """The FSDP2 units of one rank's stages on its replica group, and their step.

    ``stages``: the rank's stages by index (Sequentials of layers, their parameters real);
    ``group``: the replica group (R ranks); ``mode``: one of ``REPLICA_SHARDINGS``;
    ``mp_policy``: FSDP2's mixed precision (:func:`mixed_precision_policy`); ``fill``: for
    stages whose parameters are on the meta device, called once their shards are allocated
    on ``device`` (and every buffer emptied) to set them
    (:func:`giantpipe.engine.distributed.share.fill_shards`): sharded on meta first, as FSDP2
    documents, no rank ever allocates a whole stage.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        group: Any,
        device: torch.device,
        mode: str = DEFAULT_REPLICA_SHARDING,
        mp_policy: MixedPrecisionPolicy | None = None,
        fill: Callable[[], None] | None = None,
    ) -> None:
        self.mode = check_replica_sharding(mode)
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.mesh = DeviceMesh.from_group(group, device.type)
        ordered = [stages[s] for s in sorted(stages)]
        self.units: list[FSDPModule] = []
        self.unit_of: dict[int, FSDPModule] = {}  # id(piece) -> its unit
        self.stage_units: dict[int, list[FSDPModule]] = {s: [] for s in stages}
        # full frees each layer after its use: a unit per layer. grads and none keep every
        # layer gathered through the step: a unit per stage, one all-gather and one reduce.
        for members in units_of(ordered, per_layer=self.mode == "full"):
            unit = self._spread(members if len(members) > 1 else members[0])
            self.units.append(unit)
            self.unit_of.update((id(member), unit) for member in members)
            # A unit shared by several stages is reduced after the last of them (see reduce).
            for s, stage in stages.items():
                held = [stage, *stage.children()]
                if any(m is piece for m in members for piece in held):
                    self.stage_units[s].append(unit)
        # The root holds every stage, so that the units share one state and one set of streams
        # (a unit spanning two stages included); its forward never runs: its lazy init, which
        # the first forward would do, is done here.
        self.root = self._spread(_Held(ordered))
        if fill is not None:
            cast(nn.Module, self.root).to_empty(device=device)  # FSDP2 re-pads each shard
            fill()
        self._state().lazy_init_root()
        for unit in [*self.units, self.root]:
            unit.set_gradient_divide_factor(1.0)  # a sum: the loss is divided already
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no AVG nor PREMUL_SUM
        for unit in self.units:
            # FSDP2 prefetches, in backward, the unit that ran forward before: with V stages per
            # rank that may be one of another stage, already reduced and resharded (an
            # all-gather too many). Its "prefetch" is itself, a no-op: a unit is gathered by its
            # own pre-backward (with full, on GPUs, not overlapped with the unit after it).
            unit.set_modules_to_backward_prefetch([unit])
        self._reduced: set[int] = set()  # stages whose backward is over, this step
        self._done: set[int] = set()  # parameter groups reduced, this step
        self._keep = True  # whether this step keeps every unit gathered (see begin)

    def _spread(self, module: nn.Module | list[nn.Module]) -> FSDPModule:
        if self.mode == "none":
            spread: Any = replicate(module, mesh=self.mesh, mp_policy=self.mp_policy)
        else:
            spread = fully_shard(
                module,
                mesh=self.mesh,
                reshard_after_forward=self.mode == "full",
                mp_policy=self.mp_policy,
            )
        return spread[0] if isinstance(spread, list) else spread

    def _state(self) -> _RootState:
        return _RootState(self.root, self.mode)

    def _groups_of(self, units: Sequence[FSDPModule]) -> list[Any]:
        seen: dict[int, Any] = {}
        for unit in units:
            for group in self._state().groups_of(unit):
                seen.setdefault(id(group), group)
        return list(seen.values())

    # ---- a step --------------------------------------------------------------------------

    def run(self, run: StepRun, local: Schedule, worker: int, grad: bool) -> None:
        """Runs ``worker``'s actions of ``local`` (this rank's) as one step: :meth:`begin`, the
        actions (where the step keeps its units gathered, in parts cut after each stage's last B
        or W, where that stage is reduced: :meth:`reduce`, in the middle of the actions when
        the rank holds several stages), then :meth:`finish`."""
        actions = list(local.actions[worker])
        split = any(a.kind == "W" for a in actions)
        # The whole step's split backwards, known before its actions run in parts.
        run.split |= {(a.stage, a.microbatch) for a in actions if a.kind == "W"}
        run.w_next |= {
            (b.stage, b.microbatch)
            for b, after in zip(actions, actions[1:])
            if b.kind == "B" and after == Action("W", b.stage, b.microbatch)
        }
        self.begin(grad, split)
        cuts: dict[int, list[int]] = {}
        if grad and self._keep:  # else FSDP2 reduced each unit after each of its backwards
            for stage, index in last_backwards(actions).items():
                cuts.setdefault(index, []).append(stage)
        start = 0
        for end in sorted({*cuts, len(actions) - 1}):
            part = [acts[start : end + 1] for acts in local.actions]
            run.run(replace(local, actions=tuple(part)))
            start = end + 1
            if end in cuts:
                self.reduce(cuts[end])
        self.finish(grad)

    def begin(self, grad: bool, split: bool = False) -> None:
        """Before a step's actions (every replica, collective). With ``full`` (no split
        backward) FSDP2 runs its ZeRO-3 step: each unit gathered for each forward and backward
        and freed after it, its gradients reduce-scattered into the sharded ``p.grad`` as each
        micro-batch's backward of it ends, so at most one unit is whole at a time. With
        ``grads``, ``none``, and ``full`` under a split backward (``split``: the step has W
        actions, whose graphs hold the gathered parameters), every unit is gathered now and
        stays so, its gradients accumulating unsharded until :meth:`reduce`."""
        self.release()  # whatever a pass left gathered is stale after an optimizer step
        self._reduced.clear()
        self._done.clear()
        self._keep = self.mode != "full" or (grad and split)
        self.root.set_requires_gradient_sync(not self._keep)
        self.root.set_is_last_backward(False)
        self.root.set_reshard_after_backward(not self._keep)
        if self._keep:
            if self.mode != "none":
                self.root.set_reshard_after_forward(False)
            for unit in self.units:
                unit.unshard()  # on CUDA, the stream (not the host) waits for it

    def reduce(self, stages: Sequence[int]) -> None:
        """After the last B (or W) of each of ``stages``: their units' gradients are reduced
        over the replicas (reduce-scatter; all-reduce with ``none``), accumulated into the
        sharded ``p.grad``, and their parameters resharded. A unit shared with a stage whose
        backward is not over yet waits for that one. Nothing is left to reduce where FSDP2
        reduced each micro-batch's gradients itself (``full``, see :meth:`begin`)."""
        if not self._keep:
            return
        self._reduced.update(stages)
        units = [
            u
            for s in stages
            for u in self.stage_units[s]
            if all(t in self._reduced for t, held in self.stage_units.items() if u in held)
        ]
        groups = [g for g in self._groups_of(units) if id(g) not in self._done]
        for group in groups:
            self._done.add(id(group))
            group.reduce_grads = group.all_reduce_grads = True
            group.reshard_after_backward = True
            group.post_backward()
            # Back to accumulating: a later micro-batch's autograd callback (another stage of
            # this rank) calls post_backward on every unit again, which must then do nothing.
            group.reduce_grads = group.all_reduce_grads = False
            group.reshard_after_backward = not self._keep

    def finish(self, grad: bool) -> None:
        """After a step's actions: waits for the reduces (``grad``), and leaves every unit
        sharded, FSDP2 configured as between steps."""
        if grad:
            self.root.set_is_last_backward(True)
            self._state().final_callback()
        # FSDP2 as torch leaves it between steps (what a caller running a unit alone expects)
        self.root.set_requires_gradient_sync(True)
        self.root.set_reshard_after_backward(True)
        self.release()

    def gather(self) -> None:
        """Every unit gathered until :meth:`release` (collective, every replica): forwards in
        between communicate nothing, so replicas may run different numbers of them
        (generation, each replica decoding its own prompts)."""
        if self.mode != "none":
            self.root.set_reshard_after_forward(False)
        for unit in self.units:
            unit.unshard()

    def release(self) -> None:
        """Every unit sharded again, FSDP2 configured as between steps (no communication)."""
        if self.mode == "full":
            self.root.set_reshard_after_forward(True)
        for unit in self.units:
            unit.reshard()

    @contextmanager
    def layer_gathered(self, layer: nn.Module) -> Iterator[None]:
        """``layer``'s unit (with ``full``, the layer, or the pieces sharing its parameters)
        gathered for the block, resharded after it (collective, every replica in the same
        order); a layer without parameters gathers nothing. What generation's lockstep runs
        a layer in, one layer whole at a time (``engine/distributed/generation.py``)."""
        unit = self.unit_of.get(id(layer))
        if unit is None or self.mode == "none":
            yield
            return
        unit.unshard()
        try:
            yield
        finally:
            unit.reshard()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """:meth:`gather` for the block, then :meth:`release`."""
        self.gather()
        try:
            yield
        finally:
            self.release()


class GatheredLink:
    """A generation link (``engine/distributed/generation.py``'s RankLink) during which the pipe's
    FSDP2 units stay gathered: its ``finish`` (the end of the ring) releases them."""

    def __init__(self, link: Any, release: Callable[[], None]) -> None:
        self._link, self._release = link, release

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)

    def finish(self) -> None:
        try:
            self._link.finish()
        finally:
            self._release()


class _Held(nn.Module):
    """The FSDP2 root of a rank: its stages, whose forward the engine runs one by one."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a rank's stages run one by one, through the pipe's schedule")


class _RootState:
    """The few FSDP2 internals the pipeline drives, as torch.distributed.pipelining's stage
    does (``perform_reduce_grad``): the root's lazy init, each unit's parameter groups and the
    root's end-of-backward callback."""

    def __init__(self, root: FSDPModule, mode: str) -> None:
        contract: Any = replicate if mode == "none" else fully_shard
        self.state = contract.state(root)

    def lazy_init_root(self) -> None:
        self.state._lazy_init()  # noqa: SLF001 - what the root's first forward would do

    def groups_of(self, unit: FSDPModule) -> list[Any]:
        return list(unit._get_fsdp_state()._fsdp_param_groups)  # noqa: SLF001

    def final_callback(self) -> None:
        self.state._root_post_backward_final_callback()  # noqa: SLF001
