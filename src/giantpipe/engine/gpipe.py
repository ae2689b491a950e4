"""GPipe: the engine's module, with two front doors to the same executor.

1. torchgpipe's door: ``y = model(x); loss = f(y); loss.backward()``. ``forward`` runs the
   forward half of fill-drain, autograd calls back into the pipeline for the backward half.
2. The step door: ``loss = model.train_step(x, target, loss_fn)``. The engine owns the loss,
   so any schedule runs: ``schedule="gpipe"`` (fill-drain), ``"1f1b"``, ``"interleaved"``
   (with ``virtual_stages``) or ``"zb-h1"`` (zero bubble); see :mod:`giantpipe.engine.schedule`.

Interleaved schedules cut the model into K*V stages: ``balance`` then lists K*V layer counts
(e.g. ``solve_balance(costs, K * V)``), ``devices`` the K workers, and stage s runs on worker
s % K. A K-entry balance cannot be refined for you: worker w's layers would not be contiguous.

Example::

    >>> model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> pipe = GPipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4)
    >>> x, target = torch.randn(32, 16), torch.randint(0, 4, (32,))
    >>> loss = pipe.train_step(x, target, nn.functional.cross_entropy)  # grads in p.grad
    >>> pipe.last_stats.expected_bubble
    0.2

The autograd bridge of door 1 is :mod:`giantpipe.engine.front_door`; the checks of the arguments
are :mod:`giantpipe.engine.gpipe_args`.

Parameters keep the names they have in the plain module (``"0.weight"``, ``"2.bias"``), so a
state dict saved from one partitioning loads into any other, or into the plain model.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from giantpipe.engine.base import check_arguments, check_input
from giantpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from giantpipe.engine.executor import (
    LossFn,
    LossSpec,
    StepConfig,
    StepRun,
    autocast_state,
)
from giantpipe.engine.front_door import PipelineFunction, out_is_tensor
from giantpipe.engine.microbatch import TensorOrTensors, as_tuple, batch_size, gather, scatter
from giantpipe.engine.partition import Device, split_module
from giantpipe.engine.recompute import checkpoint_stop
from giantpipe.engine.rng import draw_step_seed, install_rng_hooks
from giantpipe.engine.schedule import Schedule, expected_bubble
from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.stats import ActionTiming, StepStats, device_peak, reset_device_peak
from giantpipe.engine.workers import WorkerPool

if TYPE_CHECKING:
    from giantpipe.perf.predict import Prediction

MOVING_DENIED = TypeError(
    "denied to move parameters and buffers, because GPipe should manage device placement"
)


@functools.lru_cache(maxsize=64)
def _schedule(name: str, workers: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    return build_schedule(name, workers, chunks, virtual_stages)


class GPipe(nn.Module):
    """Wraps a flat ``nn.Sequential`` to train it with pipeline parallelism.

    Args:
        module: the model; its children are the layers that stages are cut from.
        balance: number of layers per stage (see :mod:`giantpipe.perf.balance` to compute one).
        devices: one per stage; may repeat (``["cpu", "cpu"]`` gives CPU stand-ins). Default:
            every CUDA device, else CPU stand-ins.
        chunks: M, the number of micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'`` re-materialization.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch.
        schedule: the schedule ``train_step`` runs: ``'gpipe'``, ``'1f1b'``, ``'interleaved'``
            or ``'zb-h1'`` (``forward`` always runs fill-drain).
        virtual_stages: V, stages per worker for ``'interleaved'`` (and looped ``'gpipe'``);
            ``balance`` then has K*V entries and ``devices`` K.
        timeout: seconds a worker may wait for a neighbour before the step fails.
        threads_per_stage: intra-op threads of each worker; default: for CPU stand-ins, the
            caller's threads shared evenly among the stages, else unchanged.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Iterable[Device] | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        schedule: str = "gpipe",
        timeout: float = 300.0,
        threads_per_stage: int | None = None,
        virtual_stages: int | None = None,
    ) -> None:
        super().__init__()
        balance, chunks, v, resolved = check_arguments(
            module, balance, devices, chunks, checkpoint, schedule, virtual_stages
        )
        workers = len(balance) // v
        _schedule(schedule, workers, chunks, v)  # fail early on a bad name or M
        if deferred_batch_norm:
            convert_deferred_batch_norm(module)
        for name, layer in module.named_children():
            if hasattr(self, name) and name not in self._modules:
                raise ValueError(f"layer name {name!r} clashes with a GPipe attribute")
            self.add_module(name, layer)
        self.balance: list[int] = balance
        self.virtual_stages = v
        self.placement: list[int] = [s % workers for s in range(len(balance))]
        self.devices: list[torch.device] = [resolved[w] for w in self.placement]  # per stage
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.timeout = timeout
        self.threads_per_stage = threads_per_stage
        self.partitions: list[nn.Sequential] = split_module(module, balance, self.devices)
        self._rng_hooks = install_rng_hooks(module)
        self.last_stats: StepStats | None = None
        self.last_in_flight: list[int] = []  # per stage: most micro-batches held at once
        self.last_timings: list[ActionTiming] = []  # every action of the last step, as run
        self._worker_pool = WorkerPool()  # threads kept across steps; see close()

    # ---- Sequential-like access ------------------------------------------------------------

    def __len__(self) -> int:
        return sum(self.balance)

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self._modules.values())
        return layers[index]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def cuda(self, device: Any = None) -> GPipe:  # type: ignore[override]
        raise MOVING_DENIED

    def cpu(self) -> GPipe:
        raise MOVING_DENIED

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        # Only dtype conversions are allowed; placement belongs to the partitioning.
        if "device" in kwargs or "tensor" in kwargs:
            raise MOVING_DENIED
        if args and isinstance(args[0], (torch.device, int, str, torch.Tensor)):
            raise MOVING_DENIED
        return super().to(*args, **kwargs)

    # ---- front door 1: torchgpipe's forward / backward ------------------------------------

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Pipelines the forward pass; with grad enabled, ``backward`` is pipelined too."""
        started = time.perf_counter()
        self._reset_peaks()
        micro = scatter(check_input(input), self.chunks)
        grad = torch.is_grad_enabled()
        run = StepRun(self._step_config(grad, None), micro, pool=self._worker_pool)
        fill_drain = _schedule("gpipe", self.num_workers, self.chunks, self.virtual_stages)
        if not grad:
            run.run(fill_drain.phase("F"))
            self._commit_batchnorm()
            self._finish(run, started)
            return gather([run.results[m] for m in range(self.chunks)])
        tensors = as_tuple(input)
        phony = torch.empty(0, requires_grad=True)  # gives the output a grad_fn in any case
        out = PipelineFunction.apply(self, run, fill_drain, started, phony, *tensors)
        return out[0] if out_is_tensor(run) else out

    # ---- front door 2: the step API --------------------------------------------------------

    def train_step(
        self,
        inputs: TensorOrTensors,
        targets: TensorOrTensors,
        loss_fn: LossFn,
        loss_normalizer: Callable[[TensorOrTensors], float] | None = None,
    ) -> torch.Tensor:
        """Forward + backward of one mini-batch under ``self.schedule``; returns the loss.

        ``loss_fn(output, target)`` is called per micro-batch and must return the MEAN over
        the micro-batch; each is weighted by its share of the mini-batch so that gradients equal
        those of the un-pipelined model. With ``loss_normalizer(targets) -> n`` (e.g. the number
        of non-padding tokens), ``loss_fn`` returns a SUM and the engine divides by ``n``.
        Gradients accumulate into ``p.grad``; zero them between steps as usual.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step needs grad mode; use model(x) under torch.no_grad()")
        started = time.perf_counter()
        self._reset_peaks()
        micro = scatter(check_input(inputs), self.chunks)
        if batch_size(targets) != batch_size(inputs):
            raise ValueError(
                f"targets have batch size {batch_size(targets)}, inputs {batch_size(inputs)}"
            )
        micro_targets = scatter(targets, self.chunks)
        if loss_normalizer is None:
            total = batch_size(inputs)
            scales = [batch_size(t) / total for t in micro_targets]
        else:
            norm = float(loss_normalizer(targets))
            if not norm > 0:
                raise ValueError(f"loss_normalizer returned {norm}; it must be positive")
            scales = [1.0 / norm] * self.chunks
        spec = LossSpec(loss_fn, micro_targets, scales)
        run = StepRun(self._step_config(True, spec), micro, pool=self._worker_pool)
        run.run(self.step_schedule())
        self._commit_batchnorm()
        self._finish(run, started)
        return torch.stack([run.losses[m] for m in range(self.chunks)]).sum()

    def predict(
        self,
        inputs: TensorOrTensors,
        targets: TensorOrTensors | None = None,
        loss_fn: LossFn | None = None,
        repeats: int = 3,
    ) -> Prediction:
        """The simulator's forecast of ``train_step(inputs, targets, loss_fn)``: step time,
        samples/s, bubble and peak memory per worker, from each stage profiled on one
        micro-batch (see :mod:`giantpipe.perf.predict`). Compare with ``last_stats``.

        Example::

            pred = pipe.predict(x, y, nn.functional.cross_entropy)
            pipe.train_step(x, y, nn.functional.cross_entropy)
            print(pred.step_time_s, pipe.last_stats.span_s, pred.bubble, pipe.last_stats.bubble)
        """
        from giantpipe.perf.predict import predict  # imported here: it imports the executor

        return predict(self, inputs, targets, loss_fn, repeats)

    def close(self) -> None:
        """Stops the worker threads kept between steps (collecting the pipe does it too); a
        later step starts new ones.

        Example::

            pipe.train_step(x, y, loss_fn)  # starts giantpipe-worker-0..K-1, kept for the next
            pipe.close()                    # none left
        """
        self._worker_pool.close()

    # ---- shared plumbing ------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """K, the number of devices (workers); ``len(self.partitions)`` is K*V."""
        return len(self.partitions) // self.virtual_stages

    @property
    def worker_devices(self) -> list[torch.device]:
        """The device of each worker."""
        return self.devices[: self.num_workers]

    def step_schedule(self) -> Schedule:
        """The validated schedule ``train_step`` runs for the current configuration."""
        return _schedule(self.schedule, self.num_workers, self.chunks, self.virtual_stages)

    def _step_config(self, grad: bool, loss: LossSpec | None) -> StepConfig:
        cpu_workers = sum(d.type == "cpu" for d in self.worker_devices)
        threads = self.threads_per_stage
        if threads is None and cpu_workers > 1:  # CPU stand-ins share the cores evenly
            threads = max(1, torch.get_num_threads() // cpu_workers)
        return StepConfig(
            stages=self.partitions,
            devices=self.devices,
            checkpoint_stop=checkpoint_stop(self.checkpoint, self.chunks) if grad else 0,
            grad_enabled=grad,
            seed=draw_step_seed(),
            autocast=autocast_state(self.devices),
            loss=loss,
            threads_per_worker=threads,
            timeout=self.timeout,
            placement=self.placement,
        )

    def _reset_peaks(self) -> None:
        for device in set(self.devices):
            reset_device_peak(device)

    def _commit_batchnorm(self) -> None:
        # Deferred BatchNorm moves running statistics once per mini-batch, after all forwards.
        if self.training:
            for stage in self.partitions:
                commit_deferred_batch_norm(stage)

    def _finish(self, run: StepRun, started: float) -> None:
        # Statistics are per worker (device); an interleaved worker sums its stages.
        on_cuda = all(d.type == "cuda" for d in self.devices)
        busy = [0.0] * self.num_workers
        for stage, seconds in enumerate(run.busy):
            busy[self.placement[stage]] += seconds
        stats = StepStats.from_timings(
            wall=time.perf_counter() - started,
            span=run.span,
            busy=busy,
            peaks=[device_peak(d) for d in self.worker_devices] if on_cuda else run.worker_peaks,
            num_microbatches=self.chunks,
            memory_kind="cuda_allocator" if on_cuda else "saved_activations",
        )
        if self.virtual_stages > 1:
            bubble = expected_bubble(self.num_workers, self.chunks, self.virtual_stages)
            stats = dataclasses.replace(stats, expected_bubble=bubble)
        self.last_stats = stats
        self.last_in_flight = list(run.in_flight_peaks)
        self.last_timings = list(run.timings)
