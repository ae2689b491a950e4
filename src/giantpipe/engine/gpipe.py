"""GPipe: the local pipe, a worker thread per device, with two front doors to one executor.

torchgpipe's door, ``y = pipe(x); loss.backward()``, runs fill-drain through one autograd node
(:class:`PipelineFunction`); the step door, ``pipe.train_step(x, target, loss_fn)``, owns the
loss and so runs any schedule. Its arguments, interleaved balances and parameter names:
docs/engine.md#gpipe; what it shares with ``DistributedPipe``: :class:`~.pipe.Pipe`.

Example::

    >>> model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> pipe = GPipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=4)
    >>> x, target = torch.randn(32, 16), torch.randint(0, 4, (32,))
    >>> loss = pipe.train_step(x, target, nn.functional.cross_entropy)  # grads in p.grad
    >>> pipe.last_stats.expected_bubble
    0.2
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from giantpipe.engine.batchnorm import convert_deferred_batch_norm
from giantpipe.engine.executor import StepRun
from giantpipe.engine.meta import LayerInit, materialize, on_meta, pipe_init
from giantpipe.engine.microbatch import (
    TensorOrTensors,
    as_tuple,
    batch_size,
    forward_chunks,
    gather,
    scatter,
)
from giantpipe.engine.partition import (
    Device,
    TiedCopies,
    plain_names,
    resolve_devices,
    shared_parameters,
    split_module,
    tied_copies,
    verify_module,
)
from giantpipe.engine.pipe import (
    Normalizer,
    Pipe,
    check_batch_sizes,
    check_input,
    check_model,
)
from giantpipe.engine.rng import install_rng_hooks
from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.schedules.fill_drain import forward_schedule
from giantpipe.engine.spec import (
    DEFAULT_CHUNKS,
    DEFAULT_RECOMPUTE,
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT,
    PipelineSpec,
)
from giantpipe.engine.stats import StepStats, device_peak, memory_kind, reset_device_peak
from giantpipe.engine.step_config import LossFn, LossSpec
from giantpipe.engine.workers import WorkerPool

__all__ = ["GPipe", "PipelineFunction", "verify_module"]

MOVING_DENIED = TypeError(
    "denied to move parameters and buffers, because GPipe should manage device placement"
)


class GPipe(Pipe):
    """Wraps a flat ``nn.Sequential`` to train it with pipeline parallelism.

    Args:
        module: the model; its children are the layers that stages are cut from. Built on
            meta (:func:`~giantpipe.engine.meta.build_on_meta`), each layer is made real
            directly on its stage's device, filled by ``init``.
        balance: number of layers per stage (see :mod:`giantpipe.perf.balance` to compute one).
        devices: one per stage; may repeat (``["cpu", "cpu"]`` gives CPU stand-ins; stages on
            one GPU each run on a stream of their own). ``"cuda"`` means the current CUDA
            device. Default: every CUDA device, else CPU stand-ins.
        chunks: M, the number of micro-batches per mini-batch.
        recompute: the re-materialization mode, ``'always'``, ``'except_last'`` or
            ``'never'``: which micro-batches drop their activations and recompute them in
            backward (see :mod:`giantpipe.engine.recompute`).
        checkpoint: torchgpipe's name for ``recompute``, accepted as its alias (code written
            for torchgpipe runs unchanged); not a file.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch.
        schedule: the schedule ``train_step`` runs: ``'gpipe'``, ``'1f1b'``, ``'interleaved'``,
            ``'zb-h1'`` or ``'zb-v'`` (``forward`` always runs fill-drain).
        virtual_stages: V, stages per worker for ``'interleaved'`` and ``'zb-v'`` (and looped
            ``'gpipe'``); ``balance`` then has K*V entries and ``devices`` K.
        timeout: seconds a worker may wait for a neighbour before the step fails
            (PipelineTimeout); also how long a step waits for the threads of a failed one.
        threads_per_worker: intra-op threads of each worker; default: for CPU stand-ins, the
            caller's threads shared evenly among the workers, else unchanged.
        seed, init: what fills the layers of a model built on meta: ``init(index, layer)``
            (:mod:`giantpipe.engine.meta`); default ``seeded_init(seed)``, as
            DistributedPipe's; None leaves them unset (a state dict is loaded right after).
            Unused for a real model.
        spec: all of the above but the module at once, as a
            :class:`~giantpipe.engine.spec.PipelineSpec` (what the runner and the planner
            give); then pass no other argument. ``pipe.spec`` is the one a pipe runs.

    Example::

        spec = PipelineSpec(balance=(2, 1), chunks=4, schedule="1f1b", devices=("cpu", "cpu"))
        pipe = GPipe(model, spec=spec)      # the same as GPipe(model, [2, 1], chunks=4, ...)
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Iterable[Device] | None = None,
        chunks: int = DEFAULT_CHUNKS,
        recompute: str = DEFAULT_RECOMPUTE,
        checkpoint: str | None = None,  # torchgpipe's alias of recompute
        deferred_batch_norm: bool = False,
        schedule: str = DEFAULT_SCHEDULE,
        timeout: float = DEFAULT_TIMEOUT,
        threads_per_worker: int | None = None,
        virtual_stages: int | None = None,
        seed: int = 0,
        init: LayerInit | None | str = "seeded",
        spec: PipelineSpec | None = None,
    ) -> None:
        spec = PipelineSpec.from_keywords(
            spec,
            balance=balance,
            devices=devices,
            chunks=chunks,
            recompute=recompute,
            checkpoint=checkpoint,
            deferred_batch_norm=deferred_batch_norm,
            schedule=schedule,
            timeout=timeout,
            threads_per_worker=threads_per_worker,
            virtual_stages=virtual_stages,
        )
        workers = resolve_devices(spec.devices, spec.num_workers)
        check_model(module, spec, len(workers))
        super().__init__(spec)
        # stage -> worker, as the schedule places them (an empty pipe has none)
        self.placement = list(self.step_schedule().placement) if spec.balance else []
        self.devices = [workers[w] for w in self.placement]  # per stage
        if on_meta(module):  # each layer made real on its stage's device, one at a time
            on = [
                d for count, d in zip(self.balance, self.devices, strict=True) for _ in range(count)
            ]
            materialize(module, dict(enumerate(on)), pipe_init(init, seed))
        if spec.deferred_batch_norm:
            convert_deferred_batch_norm(module)
        for name, layer in module.named_children():
            if hasattr(self, name) and name not in self._modules:
                raise ValueError(f"layer name {name!r} clashes with a GPipe attribute")
            self.add_module(name, layer)
        names = getattr(module, "original_names", None)
        if names is not None:  # a sequentialized model: checkpoints keep the model's names
            names.install(self)
        shared = shared_parameters(module)  # before the split: copies are distinct after it
        self.partitions: list[nn.Sequential] = split_module(module, self.balance, self.devices)
        self.tied = TiedCopies(tied_copies(self.partitions, shared))
        self._rng_hooks = install_rng_hooks(module)
        self.last_in_flight: list[int] = []  # per stage: most micro-batches held at once
        self._worker_pool = WorkerPool()  # threads kept across steps; see close()
        self.register_load_state_dict_pre_hook(_read_torchgpipe_names)

    @property
    def checkpoint(self) -> str:
        """torchgpipe's name for :attr:`recompute` (the re-materialization mode), kept so that
        code written for torchgpipe reads it unchanged."""
        return self.recompute

    @property
    def worker_pool(self) -> WorkerPool:
        """The worker threads kept between steps (read-only; what ``giantpipe.perf.predict``
        replays on)."""
        return self._worker_pool

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
        """Pipelines the forward pass; with grad enabled, ``backward`` is pipelined too. Without
        grad (evaluation) any batch runs, in min(M, batch) micro-batches."""
        batch = check_input(input)
        if not self.partitions:
            return input  # an empty Sequential is the identity
        started = time.perf_counter()
        self._reset_peaks()
        grad = torch.is_grad_enabled()
        # Training splits into M micro-batches (a smaller batch is refused); a forward without
        # gradients (evaluation) takes any batch, in fewer micro-batches when it is smaller.
        chunks = self.chunks if grad else forward_chunks(batch_size(batch), self.chunks)
        micro = scatter(batch, chunks)
        run = StepRun(self.step_config(grad, None), micro, pool=self._worker_pool)
        forward = forward_schedule(
            self.num_workers, chunks, self.virtual_stages, tuple(self.placement)
        )
        if not grad:
            run.run(forward.phase("F"))
            self._commit_batchnorm()
            self._finish(run, started, chunks)
            return gather([run.results[m] for m in range(chunks)])
        tensors = as_tuple(input)
        phony = torch.empty(0, requires_grad=True)  # gives the output a grad_fn in any case
        out = PipelineFunction.apply(self, run, forward, started, phony, *tensors)
        return out[0] if isinstance(run.results[0], torch.Tensor) else out

    # ---- front door 2: the step API --------------------------------------------------------

    def train_step(
        self,
        inputs: TensorOrTensors,
        targets: TensorOrTensors,
        loss_fn: LossFn,
        loss_normalizer: Normalizer | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> torch.Tensor:
        """Forward + backward of one mini-batch under ``self.schedule``; returns the loss.

        ``loss_fn(output, target)`` is called per micro-batch and must return the MEAN over
        the micro-batch; each is weighted by its share of the mini-batch so that gradients equal
        those of the un-pipelined model. With ``loss_normalizer(targets) -> n`` (e.g. the number
        of non-padding tokens), ``loss_fn`` returns a SUM and the engine divides by ``n``.
        Gradients accumulate into ``p.grad``; zero them between steps as usual.

        ``grad_scaler`` (fp16): the gradients are those of the loss times the scaler's scale,
        as after ``scaler.scale(loss).backward()`` on the plain model; the loss returned is
        not scaled. Example::

            scaler = pipe.grad_scaler()                # torch.amp.GradScaler on CUDA
            with torch.autocast("cuda", dtype=torch.float16):
                loss = pipe.train_step(x, y, loss_fn, grad_scaler=scaler)
            scaler.step(optimizer); scaler.update()
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step needs grad mode; use model(x) under torch.no_grad()")
        started = time.perf_counter()
        self._reset_peaks()
        micro = scatter(check_input(inputs), self.chunks)
        check_batch_sizes(inputs, targets)
        spec = self._loss_spec(targets, loss_fn, loss_normalizer, self._loss_scale(grad_scaler))
        if not self.partitions:
            return _identity_step(micro, spec)
        run = StepRun(self.step_config(True, spec), micro, pool=self._worker_pool)
        self.tied.begin()
        run.run(self.step_schedule())
        self.tied.finish()
        self._commit_batchnorm()
        self._finish(run, started)
        return self._total_loss(run.losses)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips by the global 2-norm of every stage's gradients, wherever they live: equal to
        ``torch.nn.utils.clip_grad_norm_`` on the plain model (parameters in the same order).

        Example::

            pipe.train_step(x, y, loss_fn)
            norm = pipe.clip_grad_norm_(1.0)  # the norm before clipping
            optimizer.step()
        """
        followers = {id(p) for p in self.tied.followers()}  # a tied copy counts once
        counted = [p for p in self.parameters() if id(p) not in followers]
        norm = torch.nn.utils.clip_grad_norm_(counted, max_norm)
        self.tied.follow()
        return norm

    def close(self) -> None:
        """Stops the worker threads kept between steps (collecting the pipe does it too); a
        later step starts new ones.

        Example::

            pipe.train_step(x, y, loss_fn)  # starts giantpipe-worker-0..K-1, kept for the next
            pipe.close()                    # none left
        """
        self._worker_pool.close()

    # ---- plumbing -------------------------------------------------------------------------

    @property
    def worker_devices(self) -> list[torch.device]:
        """The device of each worker."""
        return self.devices[: self.num_workers]

    def _threads_per_worker(self) -> int | None:
        cpu_workers = sum(d.type == "cpu" for d in self.worker_devices)
        threads = self.spec.threads_per_worker
        if threads is None and cpu_workers > 1:
            return max(1, torch.get_num_threads() // cpu_workers)  # stand-ins share the cores
        return threads

    def _reset_peaks(self) -> None:
        for device in set(self.devices):
            reset_device_peak(device)

    def _finish(self, run: StepRun, started: float, chunks: int | None = None) -> None:
        # Statistics are per worker (device); an interleaved worker sums its stages. Workers
        # sharing a GPU have no allocator peak of their own: their saved activations instead.
        # ``chunks``: the micro-batches the step ran (a short forward without gradients: fewer).
        kind = memory_kind(self.worker_devices)
        for device in {d for d in self.devices if d.type == "cuda"}:
            torch.cuda.synchronize(device)  # the step's wall time is the kernels', not launches'
        busy, recompute = [0.0] * self.num_workers, [0.0] * self.num_workers
        for stage, seconds in enumerate(run.busy):
            busy[self.placement[stage]] += seconds
            recompute[self.placement[stage]] += run.recomputed[stage]
        peaks = run.worker_peaks
        if kind == "cuda_allocator":
            peaks = [device_peak(d) for d in self.worker_devices]
        self.last_stats = StepStats.from_timings(
            wall=time.perf_counter() - started,
            span=run.span,
            busy=busy,
            peaks=peaks,
            chunks=self.chunks if chunks is None else chunks,
            memory_kind=kind,
            virtual_stages=self.virtual_stages,
            clock="cuda_events" if run.cuda else "perf_counter",
            recompute=recompute,
        )
        self.last_in_flight = list(run.in_flight_peaks)
        self.last_timings = list(run.timings)


class PipelineFunction(torch.autograd.Function):
    """Autograd bridge of the front door: forward phase now, backward phase on ``backward()``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        pipe: GPipe,
        run: StepRun,
        schedule: Schedule,
        started: float,
        phony: Any,
        *inputs: Any,
    ) -> tuple[torch.Tensor, ...]:
        run.run(schedule.phase("F"))
        pipe._commit_batchnorm()  # the other half of GPipe.forward
        ctx.pipe, ctx.run, ctx.schedule, ctx.started = pipe, run, schedule, started
        ctx.num_inputs = len(inputs)
        out = as_tuple(gather([run.results[m] for m in range(pipe.chunks)]))
        ctx.mark_non_differentiable(
            *[t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        )
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        pipe, run = ctx.pipe, ctx.run
        chunks = pipe.chunks
        per_output = [
            scatter(g, chunks) if g is not None else [None] * chunks for g in grad_outputs
        ]
        last = len(pipe.partitions) - 1
        for m in range(chunks):
            run.post(("grad", last, m), tuple(col[m] for col in per_output))
        pipe.tied.begin()
        # On pool threads even for one worker: this is autograd's thread (on CUDA, the output
        # device's), which is not to run a stage's backward (giantpipe.engine.executor).
        run.run(ctx.schedule.phase("B"), own_threads=True)
        pipe.tied.finish()
        pipe._finish(run, ctx.started)
        grads = _gather_input_grads(run, chunks, ctx.num_inputs)
        return (None, None, None, None, None, *grads)


def _gather_input_grads(run: StepRun, chunks: int, num_inputs: int) -> list[Any]:
    grads: list[Any] = []
    for i in range(num_inputs):
        parts = [run.input_grads[m][i] for m in range(chunks)]
        grads.append(None if any(p is None for p in parts) else torch.cat(parts))
    return grads


def _identity_step(micro: list[TensorOrTensors], spec: LossSpec) -> torch.Tensor:
    # train_step of an empty pipe: the loss of the inputs themselves, weighted as in a step.
    loss = sum(
        (spec.fn(x, t) * scale for x, t, scale in zip(micro, spec.targets, spec.scales)),
        torch.zeros(()),
    )
    if loss.requires_grad:
        loss.backward()
    return loss.detach()


def _read_torchgpipe_names(module: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    # load_state_dict's pre-hook: a state dict saved from torchgpipe's GPipe loads as it is.
    plain_names(state_dict, prefix)
