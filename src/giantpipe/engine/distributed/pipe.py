"""The distributed executor: :class:`DistributedPipe`, one rank's share of the pipeline (one
process per pipeline rank under torchrun, R replicas of it).

A rank holds only its stages (built on meta, made real by share: :mod:`.share`) and runs its own
actions of the same schedule as the local executor (the same ``StepRun``, its mailbox sending to
other processes; docs/engine.md, "Beyond one process"). A failure on any rank raises
:class:`RankFailure` on every rank, naming the first.

Example (``torchrun --nproc_per_node=2 train.py``)::

    init_distributed()                                      # reads torchrun's environment
    pipe = DistributedPipe(build_model, balance=[4, 4], chunks=8)   # R = world size / K
    loss = pipe.train_step(x if pipe.needs_inputs else None,
                           y if pipe.needs_targets else None, nn.functional.cross_entropy)
    pipe.release(); end_distributed()                       # at the end: nothing left behind
"""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from giantpipe.checkpoint.load import load
from giantpipe.checkpoint.manifest import read_manifest
from giantpipe.checkpoint.save import save
from giantpipe.engine.batchnorm import convert_deferred_batch_norm, merge_deferred_batch_norm
from giantpipe.engine.distributed.clipping import clip_grad_norm_
from giantpipe.engine.distributed.collectives import all_gather_rows, all_reduce_, all_reduce_sum
from giantpipe.engine.distributed.faults import (
    FailureBoard,
    RankFailure,
    default_store,
    install_sigterm_note,
    run_guarded,
    wait_device,
)
from giantpipe.engine.distributed.generation import RankLink, from_last_stage, generation_link
from giantpipe.engine.distributed.layout import (
    Groups,
    Layout,
    bind_device,
    build_groups,
    comm_device,
    drop_groups,
    end_distributed,
    init_distributed,
    resolve_device,
    tied_workers,
    warm_up,
)
from giantpipe.engine.distributed.p2p import P2PMailbox
from giantpipe.engine.distributed.replicas import (
    DEFAULT_REPLICA_SHARDING,
    GatheredLink,
    ReplicaShards,
    check_replica_sharding,
    shard_like,
)
from giantpipe.engine.distributed.share import fill_shards, held_layers, stage_modules, templates
from giantpipe.engine.distributed.tied import TiedSync, tied_copies
from giantpipe.engine.distributed.wire import Layouts, signature
from giantpipe.engine.executor import StepRun
from giantpipe.engine.fp16 import AgreedGradScaler, check_agreed
from giantpipe.engine.meta import LayerInit, build_on_meta, materialize, on_meta, pipe_init
from giantpipe.engine.microbatch import TensorOrTensors, batch_size, forward_chunks, gather, scatter
from giantpipe.engine.partition import shared_parameters
from giantpipe.engine.pipe import Normalizer, Pipe, check_model
from giantpipe.engine.rng import draw_step_seed, install_rng_hooks, mix
from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.schedules.fill_drain import forward_schedule
from giantpipe.engine.spec import (
    DEFAULT_CHUNKS,
    DEFAULT_RECOMPUTE,
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT,
    PipelineSpec,
)
from giantpipe.engine.stats import StepStats, device_peak, reset_device_peak
from giantpipe.engine.step_config import LossFn, LossSpec

__all__ = [
    "DistributedPipe",
    "RankFailure",
    "clip_grad_norm_",
    "end_distributed",
    "init_distributed",
]

ModelSource = nn.Sequential | Callable[[], nn.Sequential]
_T = TypeVar("_T")


class DistributedPipe(Pipe):
    """This rank's share of a pipeline x data-parallel model; a step door like ``GPipe``'s.

    Args:
        module: the model (its parameters on meta, :func:`~giantpipe.engine.meta.build_on_meta`,
            or real), or a function that builds it (called with parameters on meta).
        balance: layers per stage (K*V stages: K pipeline ranks, V virtual stages each).
        chunks: M, micro-batches per mini-batch (per replica).
        recompute: the re-materialization mode, as GPipe's (``'always'``, ``'except_last'``,
            ``'never'``).
        schedule: a name of :func:`giantpipe.engine.schedules.build_schedule`.
        virtual_stages: V (interleaved schedules); default 2 for ``'interleaved'``, else 1.
        device: this rank's device (default ``cuda:LOCAL_RANK`` if CUDA, else CPU).
        seed, init: what fills the meta layers this rank holds: ``init(index, layer)``
            (:mod:`giantpipe.engine.meta`); default ``seeded_init(seed)``; None leaves them
            unset (a checkpoint is loaded right after).
        deferred_batch_norm: BatchNorm running statistics once per mini-batch, as GPipe's.
        timeout: seconds any wait for another rank may take before the run fails.
        replica_sharding: how each stage is spread over its R replicas, on FSDP2
            (:mod:`giantpipe.engine.distributed.replicas`): ``'grads'`` (ZeRO-2, the default:
            1/R of the parameters, gradients and optimizer state per rank between steps, each
            unit gathered once a step), ``'full'`` (ZeRO-3: gathered per micro-batch, one layer
            at a time) or ``'none'`` (replicated, torch's ``replicate``).
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` of the units (parameters gathered
            and gradients reduced in its types; see ``replicas.mixed_precision_policy``).
        spec: balance, chunks, recompute, schedule, virtual_stages, timeout and
            deferred_batch_norm at once (:class:`~giantpipe.engine.spec.PipelineSpec`, its
            ``devices`` unused: a rank's is ``device``); then pass none of those.

    The replicas R are the world size over the K pipeline ranks the schedule needs. With
    R > 1 this rank's parameters (``pipe.parameters()``, what its optimizer steps) are FSDP2's
    DTensors: its shards (``full``, ``grads``) or replicated copies (``none``).
    """

    def __init__(
        self,
        module: ModelSource,
        balance: Iterable[int] | None = None,
        *,
        chunks: int = DEFAULT_CHUNKS,
        recompute: str = DEFAULT_RECOMPUTE,
        schedule: str = DEFAULT_SCHEDULE,
        virtual_stages: int | None = None,
        device: torch.device | str | None = None,
        deferred_batch_norm: bool = False,
        seed: int = 0,
        init: LayerInit | None | str = "seeded",
        timeout: float = DEFAULT_TIMEOUT,
        replica_sharding: str = DEFAULT_REPLICA_SHARDING,
        mixed_precision: MixedPrecisionPolicy | None = None,
        spec: PipelineSpec | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedPipe needs a process group: call init_distributed()")
        check_replica_sharding(replica_sharding)
        spec = PipelineSpec.from_keywords(
            spec,
            balance=balance,
            chunks=chunks,
            recompute=recompute,
            schedule=schedule,
            virtual_stages=virtual_stages,
            timeout=timeout,
            deferred_batch_norm=deferred_batch_norm,
        )
        model = module if isinstance(module, nn.Sequential) else build_on_meta(module)
        check_model(model, spec)
        if not spec.balance:
            raise ValueError("a DistributedPipe needs at least one layer (GPipe pipes none)")
        super().__init__(spec)
        steps = self.step_schedule()
        self.layout = Layout(
            dist.get_world_size(), dist.get_rank(), steps.num_workers, steps.placement
        )
        self.placement = list(steps.placement)
        # The current CUDA device is this rank's own (a user may have called
        # init_process_group without init_distributed): NCCL and object collectives use it.
        self.device = bind_device(resolve_device(device))
        shared = self._shared = shared_parameters(model)  # found before the layers are copied
        self._hold_layers(model, seed, init, spec.deferred_batch_norm)
        self.groups = build_groups(self.layout, self.timeout, self.device)
        self.board = FailureBoard(default_store(), self.layout.label())
        peers = self.layout.pipeline_ranks + self.layout.replica_ranks
        self.board.watch(self.layout.rank, peers, self.layout.rank_label)
        install_sigterm_note(self.board)
        self._uses: dict[int, int] = {}
        self.replica_sharding = replica_sharding
        self.shards = self._spread(replica_sharding, mixed_precision)
        # After the spread: the tied copies are its DTensors.
        where = (self.layout, self.balance, self.placement, self.timeout, self.device)
        self.tied = tied_copies(model, shared, *where, self.board)
        # Every NCCL communicator now, in one order, not lazily inside step 1 (layout.warm_up).
        tied = tied_workers(shared, self.balance, self.placement)
        warm_up(self.layout, self.groups, tied, self.device, self.timeout, self.board)
        self._box: P2PMailbox | None = None
        # Each boundary value's layout per layout of the step's inputs, as both of its ends
        # learned it: from the second step of an input layout on, bytes alone cross (p2p.py).
        self._layouts = Layouts()
        self._broken: str | None = None

    def _hold_layers(
        self, model: nn.Sequential, seed: int, init: LayerInit | None | str, deferred: bool
    ) -> None:
        """Makes this rank's layers real on its device (the others stay on meta) and registers
        them; with R > 1 replicas of a model on meta they stay on meta until :meth:`_spread`
        gives each its shards (:mod:`.share`)."""
        self._rng_hooks = install_rng_hooks(model)  # numbered over the whole model, as GPipe
        layer_init = pipe_init(init, seed)
        self._init, held = layer_init, held_layers(self.balance, self.layout.local_stages)
        self._meta_copies: dict[int, nn.Module] | None = None
        if self.layout.replicas > 1 and on_meta(model):
            self._meta_copies = templates(model, held)  # the unsharded layers, for their values
        else:
            materialize(model, dict.fromkeys(held, self.device), layer_init)
        self.partitions = stage_modules(model, self.balance, self.layout.local_stages)
        self.devices = [self.device] * len(self.partitions)
        for part in self.partitions:
            if deferred:
                convert_deferred_batch_norm(part)
            for name, layer in part.named_children():
                self.add_module(name, layer)
        names = getattr(model, "original_names", None)
        if names is not None:  # a sequentialized model: checkpoints keep the model's names
            names.install(self)

    def _spread(self, mode: str, policy: MixedPrecisionPolicy | None) -> ReplicaShards | None:
        """This rank's stages on FSDP2 over its replica group (None with R = 1); built on meta,
        sharded there, then each shard set to its part of the unsharded init."""
        stages = self.layout.local_stages
        if self.layout.replicas == 1:
            return None
        fill, copies, self._meta_copies = None, self._meta_copies, None
        if copies is not None:
            layers = [layer for s in stages for layer in self.partitions[s].children()]
            held = dict(zip(held_layers(self.balance, stages), layers, strict=True))
            tied = [place for group in self._shared for place in group[1:]]
            fill = functools.partial(fill_shards, held, copies, self._init, self.device, tied)
        parts = {s: self.partitions[s] for s in stages}
        return ReplicaShards(parts, self.groups.replica, self.device, mode, policy, fill)

    # ---- who needs what ------------------------------------------------------------------

    @property
    def needs_inputs(self) -> bool:
        """Whether this rank's ``train_step`` needs ``inputs`` (it holds stage 0)."""
        return self.layout.needs_inputs

    @property
    def needs_targets(self) -> bool:
        """Whether this rank's ``train_step`` needs ``targets`` (it holds the last stage)."""
        return self.layout.needs_targets

    @property
    def replica(self) -> int:
        """This rank's replica: its data shard index (out of ``replicas``)."""
        return self.layout.replica

    @property
    def replicas(self) -> int:
        """R, the number of replicas of the pipeline (world size / K)."""
        return self.layout.replicas

    # ---- steps -------------------------------------------------------------------------------

    def train_step(
        self,
        inputs: TensorOrTensors | None = None,
        targets: TensorOrTensors | None = None,
        loss_fn: LossFn | None = None,
        loss_normalizer: Normalizer | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> torch.Tensor:
        """Forward + backward of this replica's mini-batch; returns the global loss everywhere.

        As ``GPipe.train_step``, with the mean (or ``loss_normalizer``) taken over the
        batches of all replicas, whose gradients are summed: a step equals the plain model on
        the concatenation of the replicas' batches. Gradients accumulate into ``p.grad``.
        ``grad_scaler`` (fp16, on every rank): an AgreedGradScaler (``pipe.grad_scaler()``),
        whose inf/NaN verdict every rank shares; gradients scaled, the loss not.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step needs grad mode; use eval_step under torch.no_grad()")
        check_agreed(grad_scaler, self.layout.world_size)
        scale = self._loss_scale(grad_scaler)  # every rank: each unscales its own gradients
        return self._guarded(
            lambda: self._step(True, inputs, targets, loss_fn, loss_normalizer, scale)
        )

    def eval_step(
        self,
        inputs: TensorOrTensors | None = None,
        targets: TensorOrTensors | None = None,
        loss_fn: LossFn | None = None,
        loss_normalizer: Normalizer | None = None,
    ) -> torch.Tensor:
        """The loss of a forward without gradients (global over replicas), on every rank; a
        batch smaller than M runs in fewer micro-batches (as ``forward``)."""
        with torch.no_grad():
            return self._guarded(
                lambda: self._step(False, inputs, targets, loss_fn, loss_normalizer)
            )

    def forward(self, inputs: TensorOrTensors | None = None) -> TensorOrTensors | None:
        """Pipelined forward without gradients: the outputs on last-stage ranks, None elsewhere."""
        with torch.no_grad():
            return self._guarded(lambda: self._forward(inputs))

    def _forward(self, inputs: TensorOrTensors | None) -> TensorOrTensors | None:
        started = time.perf_counter()
        chunks = self._forward_chunks(inputs)
        run = self._run(False, None, self._scatter(inputs, chunks), self._forward_steps(chunks))
        self._finish(run, started, None, chunks)
        if not self.needs_targets:
            return None
        return gather([run.results[m] for m in range(chunks)])

    def _forward_chunks(self, inputs: TensorOrTensors | None) -> int:
        """Collective (this replica's pipeline): a forward without gradients runs M micro-batches
        or fewer (:func:`forward_chunks`) by the batch stage 0's rank alone sees. A sum on the
        host group, as the loss normaliser: every rank needs the count's schedule to start the
        step whose first message brings the seed."""
        size = 0
        if self.needs_inputs:
            if inputs is None:
                raise ValueError(f"{self.layout.label()} holds stage 0 and needs inputs")
            size = batch_size(inputs if isinstance(inputs, torch.Tensor) else tuple(inputs))
        if len(self.layout.pipeline_ranks) > 1:
            group, what = self.groups.host_pipeline, "the evaluation batch's size"
            size = round(all_reduce_sum(float(size), group, self.timeout, self.board, what))
        return forward_chunks(size, self.chunks)

    def _forward_steps(self, chunks: int) -> Schedule:
        """Fill-drain's forwards over this pipe's stages for ``chunks`` micro-batches."""
        steps = forward_schedule(self.num_workers, chunks, self.virtual_stages, (*self.placement,))
        return steps.phase("F")

    def _step(
        self,
        grad: bool,
        inputs: TensorOrTensors | None,
        targets: TensorOrTensors | None,
        loss_fn: LossFn | None,
        loss_normalizer: Normalizer | None,
        loss_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        started = time.perf_counter()
        if loss_fn is None:
            raise ValueError("loss_fn is required (on every rank, though only the last uses it)")
        chunks = self.chunks if grad else self._forward_chunks(inputs)
        spec = self._rank_loss_spec(targets, loss_fn, loss_normalizer, loss_scale, chunks)
        if grad:
            self.tied.begin()  # first: the sums below then cover this step only
        steps = self.step_schedule() if grad else self._forward_steps(chunks)
        run = self._run(grad, spec, self._scatter(inputs, chunks), steps)
        if grad:
            self.tied.finish()  # after the replicas' reduce (in _run)
        self._commit_batchnorm()
        loss = self._total_loss(run.losses, chunks) if run.losses else None
        return self._finish(run, started, loss, chunks)

    def _merge_batchnorm(self, stage: nn.Module) -> None:
        # Deferred BatchNorm statistics of the whole mini-batch, across replicas: every replica
        # then commits the same running statistics as the un-replicated model would.
        if self.groups.replica is not None:
            what = "BatchNorm statistics"
            merge_deferred_batch_norm(
                stage, lambda t: all_reduce_(t, self.groups.replica, self.timeout, self.board, what)
            )

    def _scatter(self, inputs: TensorOrTensors | None, chunks: int) -> list[TensorOrTensors]:
        if not self.needs_inputs:
            return []
        if inputs is None:
            raise ValueError(f"{self.layout.label()} holds stage 0 and needs inputs")
        return scatter(inputs if isinstance(inputs, torch.Tensor) else tuple(inputs), chunks)

    def _rank_loss_spec(
        self,
        targets: TensorOrTensors | None,
        loss_fn: LossFn,
        normalizer: Normalizer | None,
        loss_scale: torch.Tensor | None = None,
        chunks: int | None = None,
    ) -> LossSpec:
        """The loss where this rank holds the last stage; an empty one elsewhere."""
        if not self.needs_targets:
            return LossSpec(loss_fn, [], [])
        if targets is None:
            raise ValueError(f"{self.layout.label()} holds the last stage and needs targets")
        return self._loss_spec(targets, loss_fn, normalizer, loss_scale, chunks)

    def _reduce_normalizer(self, norm: float) -> float:
        # The mean (or the normalizer) is over the batches of all replicas.
        if self.groups.host_replica is None:
            return norm
        group = self.groups.host_replica  # a host number: a CPU tensor on a gloo group
        return all_reduce_sum(norm, group, self.timeout, self.board, "the loss normaliser")

    def _run(
        self, grad: bool, spec: LossSpec | None, micro: list[TensorOrTensors], steps: Schedule
    ) -> StepRun:
        """Runs this rank's actions of ``steps`` with a mailbox that reaches the other ranks."""
        reset_device_peak(self.device)
        worker = self.layout.worker
        mine = tuple(acts if w == worker else () for w, acts in enumerate(steps.actions))
        local = Schedule(steps.name, steps.num_stages, steps.chunks, mine, steps.placement)
        config = self.step_config(grad, spec, seed=0)
        seed = inputs = None
        if self.needs_inputs:  # what every rank of the pipeline learns at the step's start
            seed = self._draw_seed()
            inputs = (grad, self.training, tuple(config.autocast), signature(micro))
        groups, device = self.groups, comm_device(self.device)
        box = P2PMailbox(
            self.layout, groups.control, groups.p2p, self.timeout, self.board, device, self._layouts
        )
        self._box = box
        config.seed = box.start(steps.actions, seed, inputs)
        run = StepRun(config, micro, mailbox=box)
        if self.shards is None:
            run.run(local)
        else:  # the units gathered once, each stage reduced after its last B (or W)
            self.shards.run(run, local, self.layout.worker, grad)
        box.finish()
        return run

    def _draw_seed(self) -> int:
        """The step's dropout seed, drawn where stage 0 is (as GPipe draws it from the caller's
        RNG); the step's start message takes it to the pipeline's other ranks. Replicas see
        other data and get other masks (replica 0's equal the local executor's)."""
        value = draw_step_seed()
        return value if self.layout.replica == 0 else mix(value, self.layout.replica)

    # ---- failures ----------------------------------------------------------------------------

    def _guarded(self, body: Callable[[], _T]) -> _T:
        """Runs a step; a failure tears down this rank's groups (waking every rank waiting on
        it, see :mod:`giantpipe.engine.distributed.faults`) and raises RankFailure. The pipe is
        unusable afterwards."""
        if self._broken is not None:
            raise RankFailure(f"the pipeline failed earlier and cannot run: {self._broken}")
        return run_guarded(body, self.layout, self.board, self._teardown)

    def release(self) -> None:
        """Lets go of every pending request and buffer before the process group is destroyed:
        a gloo request that outlives its group is destroyed during interpreter shutdown, which
        can abort the process after a run that succeeded. The pipe cannot step afterwards.

        Example::

            pipe.release()
            end_distributed()
        """
        if self._box is not None:
            self._box.drop()
            self._box = None
        self.tied = TiedSync([], self.timeout)
        self._broken = self._broken or "the pipe was released"
        gc.collect()

    def _teardown(self, message: str) -> None:
        self._broken = message
        if self._box is not None:
            self._box.drop()
        groups, self.groups = self.groups, Groups.torn_down()
        drop_groups(groups)
        del groups
        gc.collect()  # a group (or request) still referenced keeps its connections open

    def _finish(
        self, run: StepRun, started: float, local_loss: torch.Tensor | None, chunks: int = 0
    ) -> torch.Tensor:
        """The global loss on every rank; the step's statistics in ``last_stats`` (a step of
        ``chunks`` micro-batches; 0: M).

        Every rank of the pipeline contributes a row, ``[loss, wall, span, busy, peak,
        recompute]`` (busy and recompute: its stages' seconds; peak: saved activations on CPU,
        the allocator's on CUDA); after one all-gather each holds the whole table, so the loss
        (the last stage's row) and the statistics are the same on every rank. Rows and the
        loss are host numbers: they go over the host groups.
        """
        layout, on_cuda = self.layout, self.device.type == "cuda"
        if on_cuda:
            # The wall time of the kernels, not of their launches; first, so that the loss's
            # read-back below never blocks behind a hung NCCL operation (faults.wait_device). On
            # the current stream: NCCL's waits and the executor's side streams join it.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            what = f"the step's kernels and transfers on {self.device}"
            wait_device(event, self.timeout, what, self.board)
        if self._box is not None:  # no value from a step whose transfers failed
            self._box.check()
        loss = 0.0 if local_loss is None else float(local_loss)
        if local_loss is not None and self.groups.host_replica is not None:
            group = self.groups.host_replica
            loss = all_reduce_sum(loss, group, self.timeout, self.board, "the loss")
        peak = device_peak(self.device) if on_cuda else run.worker_peaks[layout.worker]
        busy = sum(run.busy[s] for s in layout.local_stages)
        recompute = sum(run.recomputed[s] for s in layout.local_stages)
        wall = time.perf_counter() - started
        row = torch.tensor([loss, wall, run.span, busy, peak, recompute], dtype=torch.float64)
        group, ranks = self.groups.host_pipeline, layout.pipeline_ranks
        table = all_gather_rows(row, group, ranks, self.timeout, self.board)
        kind = "cuda_allocator" if on_cuda else "saved_activations"
        clock = "cuda_events" if run.cuda else "perf_counter"
        self.last_stats = StepStats.from_table(
            table[:, 1:], chunks or self.chunks, kind, self.virtual_stages, clock
        )
        self.last_timings = list(run.timings)  # this rank's actions
        return table[self.placement[-1], 0].to(torch.float32)

    def grad_scaler(self, **kwargs: Any) -> AgreedGradScaler:
        """A gradient scaler whose inf/NaN check every rank of the world agrees on (fp16):
        every rank steps, or every rank skips and halves its scale. ``kwargs`` are
        GradScaler's.

        Example::

            scaler = pipe.grad_scaler(init_scale=2.0**16)
            loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
            scaler.step(optimizer); scaler.update()
        """
        return AgreedGradScaler(self, **kwargs)

    def all_reduce_world_(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Sums a device tensor in place over every rank of the world, under the pipe's
        timeout (what its AgreedGradScaler's verdict needs); ``what`` names it in a failure."""
        group = self.groups.p2p  # every rank of the world, on the device's backend
        if group is None:
            raise RuntimeError("the pipeline failed earlier; its ranks can no longer agree")
        return all_reduce_(tensor, group, self.timeout, self.board, what)

    def generation_link(self, timeout: float) -> RankLink | GatheredLink:
        """This rank's ends of the ring :func:`giantpipe.engine.generate.generate` circles."""
        return generation_link(self, timeout)  # engine/distributed/generation.py

    def share_outputs(self, outputs: Any) -> Any:
        """The last stage's :meth:`forward` outputs on every rank of this pipeline, on the host
        (collective over the pipeline; the door ``engine.inference.PipedModel`` takes)."""
        return from_last_stage(self, outputs)

    def norm_group(self) -> Any:
        """The device group the global norm is summed over: the pipeline's ranks, and with
        R > 1 every rank of the world (each replica holds a shard of its stage's gradients)."""
        return self.groups.pipeline if self.layout.replicas == 1 else self.groups.p2p

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Collective. Clips by the global 2-norm over every stage of the pipeline and every
        replica's shard (:mod:`giantpipe.engine.distributed.clipping`): equal to
        ``torch.nn.utils.clip_grad_norm_`` on the plain model. Returns the norm, on every rank.

        Example::

            pipe.train_step(x, y, loss_fn)
            norm = pipe.clip_grad_norm_(1.0)
            optimizer.step()
        """
        return clip_grad_norm_(self, max_norm, group=self.norm_group(), device=self.device)

    # ---- state -------------------------------------------------------------------------------

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Loads this rank's entries of a full (or any partial) un-partitioned state dict. A
        whole tensor for one of this rank's FSDP2 parameters gives it its own shard (sliced
        here, no communication); a DTensor is copied as it is."""
        own = self.state_dict()
        local = {k: shard_like(v, own[k]) for k, v in state_dict.items() if k in own}
        return super().load_state_dict(local, strict=strict, assign=assign)

    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int = 0, extra: dict[str, Any] | None = None
    ) -> None:
        """Collective. Every rank of replica 0 writes its stages' tensors (with FSDP2, every
        rank its shards, gathered nowhere); rank 0 commits the manifest."""
        self._guarded(lambda: save(self, directory, step, extra, self.groups.control))

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Loads this rank's names from whichever shards hold them (with FSDP2, only the parts
        of its own shards); returns the manifest."""
        manifest = read_manifest(directory)
        own = self.state_dict()
        self.load_state_dict(load(directory, own.keys(), self.device, like=own))
        return manifest
