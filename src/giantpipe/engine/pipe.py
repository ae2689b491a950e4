"""The base both pipes share: :class:`Pipe`, what a step needs besides its transport.

The pipes' shape (a :class:`~giantpipe.engine.spec.PipelineSpec`), the check of the model
against it, the loss scaling, the configuration of a step, deferred BatchNorm's commit and the
global-norm clip; ``GPipe`` and ``DistributedPipe`` add their transport, and the distributed one
its hooks: docs/engine-internals.md#what-both-pipes-share.

Example::

    class MyPipe(Pipe):                   # what GPipe and DistributedPipe do in __init__
        def __init__(self, module, spec: PipelineSpec):
            check_model(module, spec)
            super().__init__(spec)
            self.partitions = ...; self.devices = ...; self.placement = ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from giantpipe.engine.batchnorm import commit_deferred_batch_norm
from giantpipe.engine.fp16 import current_scale
from giantpipe.engine.microbatch import TensorOrTensors, batch_size, scatter
from giantpipe.engine.partition import verify_module
from giantpipe.engine.recompute import recompute_stop
from giantpipe.engine.rng import RngHooks, draw_step_seed
from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.spec import PipelineSpec, virtual_stages_of
from giantpipe.engine.stats import ActionTiming, StepStats
from giantpipe.engine.step_config import LossFn, LossSpec, StepConfig, autocast_state

Normalizer = Callable[[TensorOrTensors], float]


def check_model(module: nn.Sequential, spec: PipelineSpec, num_devices: int | None = None) -> None:
    """What a spec cannot check without the model: a flat Sequential whose length the balance
    covers and, given ``num_devices``, devices enough for its stages
    (:meth:`PipelineSpec.check_against`; torchgpipe's TypeError / ValueError / IndexError and
    messages).

    >>> check_model(nn.Sequential(nn.ReLU(), nn.ReLU()), PipelineSpec((1, 1)))
    """
    verify_module(module)
    spec.check_against(len(module), num_devices)


class Pipe(nn.Module):
    """The base of both pipes: what a step needs besides its transport.

    Subclasses set ``partitions`` (K*V stages, in order), ``devices`` (one per stage),
    ``placement`` (the worker of each stage) and ``_rng_hooks`` (what
    :func:`~giantpipe.engine.rng.install_rng_hooks` returned for the model) before their first
    step.
    """

    partitions: Sequence[nn.Module]
    devices: list[torch.device]
    placement: list[int]
    _rng_hooks: RngHooks

    def __init__(self, spec: PipelineSpec) -> None:
        super().__init__()
        self._spec = spec
        self.last_stats: StepStats | None = None
        self.last_timings: list[ActionTiming] = []  # this process's actions of the last step

    # ---- the shape, read-only: one PipelineSpec, checked (and its schedule built) once ------

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline's shape (balance, M, V, schedule, recompute, timeout, ...).

        Example::

            pipe = GPipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4)
            pipe.spec.chunks, pipe.spec.recompute      # 4, 'except_last'
        """
        return self._spec

    @property
    def balance(self) -> list[int]:
        """Layers per stage (K*V stages)."""
        return list(self._spec.balance)

    @property
    def chunks(self) -> int:
        """M, micro-batches per mini-batch."""
        return self._spec.chunks

    @property
    def virtual_stages(self) -> int:
        """V, stages per worker."""
        return virtual_stages_of(self._spec.schedule, self._spec.virtual_stages)

    @property
    def schedule(self) -> str:
        """The name of the schedule ``train_step`` runs."""
        return self._spec.schedule

    @property
    def recompute(self) -> str:
        """The re-materialization mode: 'always', 'except_last' or 'never'."""
        return self._spec.recompute

    @property
    def timeout(self) -> float:
        """Seconds any wait for a neighbour may take before the step fails."""
        return self._spec.timeout

    @property
    def num_workers(self) -> int:
        """K, the number of workers (devices or ranks); ``len(self.partitions)`` is K*V."""
        return self._spec.num_workers

    def step_schedule(self) -> Schedule:
        """The validated schedule ``train_step`` runs (the spec's, built once)."""
        return self._spec.step_schedule()

    # ---- what this process feeds (the local pipe: everything; a rank: its stages' part) -------

    @property
    def needs_inputs(self) -> bool:
        """Whether ``train_step`` here needs ``inputs`` (this process holds stage 0)."""
        return True

    @property
    def needs_targets(self) -> bool:
        """Whether ``train_step`` here needs ``targets`` (this process holds the last stage)."""
        return True

    @property
    def replica(self) -> int:
        """This process's data-parallel replica: its share of each batch (out of ``replicas``)."""
        return 0

    @property
    def replicas(self) -> int:
        """R, the data-parallel copies of the pipeline."""
        return 1

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        loss_normalizer: Normalizer | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> torch.Tensor:
        """Forward + backward of this process's part of one mini-batch under the schedule;
        returns the loss (see GPipe.train_step and DistributedPipe.train_step). With
        ``grad_scaler`` the gradients are scaled by its scale, the loss is not."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scales every stage's gradients so that their global 2-norm is at most ``max_norm``;
        returns the norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does on the
        plain model.

        Example::

            loss = pipe.train_step(x, y, loss_fn)
            norm = pipe.clip_grad_norm_(1.0)
            optimizer.step()
        """
        raise NotImplementedError

    # ---- the loss --------------------------------------------------------------------------

    def _loss_spec(
        self,
        targets: TensorOrTensors,
        loss_fn: LossFn,
        normalizer: Normalizer | None,
        loss_scale: torch.Tensor | None = None,
        chunks: int | None = None,
    ) -> LossSpec:
        """The loss of each micro-batch and its weight
        (docs/engine-internals.md#what-both-pipes-share); ``loss_scale``: what
        :meth:`_loss_scale` gave, the gradients' scale; ``chunks``: the micro-batches of the
        step (M; an evaluation of a smaller batch runs fewer)."""
        chunks = self.chunks if chunks is None else chunks
        micro = scatter(targets, chunks)
        norm = float(normalizer(targets)) if normalizer else float(batch_size(targets))
        norm = self._reduce_normalizer(norm)
        if not norm > 0:
            raise ValueError(f"the loss normalizer is {norm}; it must be positive")
        if normalizer is None:
            weights = [batch_size(t) / norm for t in micro]
        else:
            weights = [1.0 / norm] * chunks
        return LossSpec(loss_fn, micro, weights, loss_scale)

    def grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler:
        """A gradient scaler for this pipe (fp16): torch's, on the last stage's device type; it
        unscales each device's gradients and sums their inf checks. DistributedPipe returns one
        whose check every rank agrees on. ``kwargs`` are GradScaler's.

        Example::

            scaler = pipe.grad_scaler(init_scale=2.0**16)
            loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
        """
        # The scale lives where the loss is (the last stage's device); torch's scaler copies
        # 1/S to each other device's gradients and sums the devices' inf checks.
        return torch.amp.GradScaler(self.devices[-1].type if self.devices else "cpu", **kwargs)

    def _loss_scale(self, grad_scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
        """The scaler's scale on the last stage's device (this process's device on a rank),
        with no host sync; None without an enabled scaler. Called on every process, so that
        each has a scale to unscale its own gradients with.

        Example::

            pipe = GPipe(nn.Sequential(nn.Linear(2, 2)), balance=[1], devices=["cpu"])
            pipe._loss_scale(torch.amp.GradScaler("cpu", init_scale=4.0))   # tensor(4.)
        """
        return current_scale(grad_scaler, self.devices[-1]) if self.devices else None

    def _reduce_normalizer(self, norm: float) -> float:
        """The normalizer of the whole step; DistributedPipe sums it over the replicas."""
        return norm

    def _total_loss(
        self, losses: dict[int, torch.Tensor], chunks: int | None = None
    ) -> torch.Tensor:
        """The step's loss: the sum of the scaled losses of its ``chunks`` (M) micro-batches."""
        count = self.chunks if chunks is None else chunks
        return torch.stack([losses[m] for m in range(count)]).sum()

    # ---- the step --------------------------------------------------------------------------

    def step_config(self, grad: bool, loss: LossSpec | None, seed: int | None = None) -> StepConfig:
        """What the executor is given for a step; draws the step's dropout seed (from the
        caller's RNG) unless ``seed`` is set.

        Example::

            config = pipe.step_config(True, None, seed=0)
            config.recompute_stop, config.timeout        # 3, 300.0 for M=4, except_last
        """
        self._rng_hooks.refresh()  # a dropout's p may have changed since the last step
        return StepConfig(
            stages=self.partitions,
            devices=self.devices,
            recompute_stop=recompute_stop(self.recompute, self.chunks) if grad else 0,
            grad_enabled=grad,
            seed=draw_step_seed() if seed is None else seed,
            autocast=autocast_state(self.devices),
            loss=loss,
            threads_per_worker=self._threads_per_worker(),
            timeout=self.timeout,
            placement=self.placement,
        )

    def _threads_per_worker(self) -> int | None:
        return self._spec.threads_per_worker

    def _commit_batchnorm(self) -> None:
        # Deferred BatchNorm moves running statistics once per mini-batch, after all forwards.
        if self.training:
            for stage in self.partitions:
                self._merge_batchnorm(stage)
                commit_deferred_batch_norm(stage)

    def _merge_batchnorm(self, stage: nn.Module) -> None:
        """Before a commit; DistributedPipe merges the replicas' statistics here."""


def check_batch_sizes(inputs: TensorOrTensors, targets: TensorOrTensors) -> None:
    """Raises ValueError when targets and inputs disagree on the batch size.

    >>> check_batch_sizes(torch.zeros(4, 2), torch.zeros(4))
    """
    if batch_size(targets) != batch_size(inputs):
        raise ValueError(
            f"targets have batch size {batch_size(targets)}, inputs {batch_size(inputs)}"
        )


def check_input(input: Any) -> TensorOrTensors:
    """A batch as the engine takes it: a tensor, or a tuple holding at least one tensor.

    >>> check_input([torch.zeros(2), None])
    (tensor([0., 0.]), None)
    """
    if isinstance(input, torch.Tensor):
        return input
    if isinstance(input, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in input):
        return tuple(input)
    raise TypeError(f"expected Tensor or Tuple[Tensor, ...], but got {type(input).__name__}")
