"""The executor both pipes run: :class:`StepRun`, one step of any schedule by the pipe's workers.

Each worker runs its list of actions in order on its own thread (a ``GPipe``'s mailbox joins
threads, a ``DistributedPipe``'s reaches other processes); an action waits only for what it
consumes, and a failing one aborts the step with the stage's own exception. Why each backward
runs on its worker's thread, and what CUDA asks: docs/engine-internals.md#the-executor.

Example::

    spec = LossSpec(nn.functional.cross_entropy, micro_targets, scales=[0.25] * 4)
    config = StepConfig(stages, devices, recompute_stop=3, grad_enabled=True, seed=7, loss=spec)
    run = StepRun(config, micro_inputs)
    run.run(build_schedule("1f1b", len(stages), 4))
    loss = sum(run.losses.values())
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from giantpipe.engine.autograd import backward_here, detach, make_leaves, pair_gradients
from giantpipe.engine.failures import Aborted, PipelineError, failed_action, note_failure
from giantpipe.engine.fp16 import scale_gradient
from giantpipe.engine.mailbox import Mailbox
from giantpipe.engine.microbatch import (
    CopyStreams,
    Ready,
    TensorOrTensors,
    as_tuple,
    nbytes,
    to_device,
)
from giantpipe.engine.profiling import arrived, interleave, interleaves, profiled
from giantpipe.engine.recompute import recomputing
from giantpipe.engine.rng import rng_context
from giantpipe.engine.schedules.actions import Action, Schedule
from giantpipe.engine.split_backward import WeightGradient, backward_input
from giantpipe.engine.stats import (
    ActionTiming,
    CudaClock,
    SavedTensorMeter,
    saved_as_aliases,
    storage_keys,
)
from giantpipe.engine.step_config import StepConfig
from giantpipe.engine.streams import (
    Lane,
    enter_lane,
    join_from_caller,
    join_to_caller,
    plan_lanes,
)
from giantpipe.engine.workers import WorkerPool

__all__ = ["PipelineError", "StepRun", "failed_action"]


class StepRun:
    """State of one training (or inference) step, shared by the workers of its phases.

    The front door runs the forward phase in ``forward()`` and the backward phase when autograd
    calls back; the step API runs the whole schedule at once. Both use :meth:`run`.
    """

    def __init__(
        self,
        config: StepConfig,
        inputs: list[TensorOrTensors],
        mailbox: Mailbox | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        self.cfg = config
        # Threads that run the workers; without one, each phase starts and joins its own.
        self.pool = pool
        k = len(config.stages)
        # A rank of the distributed executor passes a mailbox that sends to other processes
        # (giantpipe.engine.distributed.p2p); its ``inputs`` are empty unless it holds stage 0.
        self.mailbox = mailbox if mailbox is not None else Mailbox(config.timeout)
        self.leaves: list[dict[int, Any]] = [{} for _ in range(k)]
        self.held: list[dict[int, int]] = [{} for _ in range(k)]
        self.outputs: list[dict[int, Any]] = [{} for _ in range(k)]
        self.results: dict[int, TensorOrTensors] = {}  # last stage's outputs (front door)
        self.losses: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, tuple[Any, ...]] = {}
        self.busy = [0.0] * k
        self.waited = [0.0] * k  # time inside actions spent waiting for a neighbour
        self.recomputed = [0.0] * k  # time inside B actions spent re-materializing
        self.received = [0] * k  # bytes taken from the mailbox (activations, gradients)
        self.kept = [0] * k  # bytes added to what the stage holds for backward
        self.timings: list[ActionTiming] = []  # every action run, in the order they ended
        self.span = 0.0
        self.live = [0] * k
        self.peaks = [0] * k
        # Per stage, micro-batches whose activations are held (F done, B or W not yet).
        self.in_flight = [0] * k
        self.in_flight_peaks = [0] * k
        # Per worker (interleaved schedules put several stages on one worker).
        self.worker_of = list(config.placement) if config.placement else list(range(k))
        self.worker_live = [0] * (max(self.worker_of) + 1)
        self.worker_peaks = [0] * (max(self.worker_of) + 1)
        self.worker_device = [config.devices[0]] * len(self.worker_peaks)
        for stage, w in enumerate(self.worker_of):
            self.worker_device[w] = config.devices[stage]
        # On CUDA: values handed on with their producer's event, copies between devices on
        # side streams, actions timed with events.
        self.cuda = any(d.type == "cuda" for d in config.devices)
        self.copies = CopyStreams() if self.cuda else None
        self.ready: dict[tuple[str, int, int], Ready] = {}  # see post()
        self.clock: CudaClock | None = None
        self.cuda_marks: list[list[Any] | None] = [None] * k  # the running action's marks
        self.cuda_actions: list[tuple[int, list[Any]]] = []  # (index in timings, its marks)
        self.pending: list[dict[int, WeightGradient | None]] = [{} for _ in range(k)]
        self.split: set[tuple[int, int]] = set()  # (stage, m) whose backward a W completes
        self.w_next: set[tuple[int, int]] = set()  # ... and whose W is its worker's next action
        self.param_storages: list[frozenset[int] | None] = [None] * k  # what meters exclude
        self.saved_bytes: dict[tuple[int, tuple[Any, ...]], int] = {}  # see _run_saving
        self.updates_buffers = [False] * k  # the stage's forward updates a buffer in place
        for m, x in enumerate(inputs):
            self.post(("act", 0, m), x)

    def post(self, key: tuple[str, int, int], value: Any) -> None:
        """Hands ``value`` to the worker that takes ``key``; call it in the producer's thread
        right after computing the value. On CUDA it first records the value's events on the
        producer's current streams, which the consumer waits for (:meth:`_arrive`).

        Example (the front door hands the output gradients to the last stage)::

            run.post(("grad", last, m), grads_of_m)
        """
        if self.copies is not None and self.mailbox.consumed_here(key):
            self.ready[key] = self.copies.ready(value)
        self.mailbox.put(key, value)

    # ---- running a phase -------------------------------------------------------------------

    def run(self, schedule: Schedule, own_threads: bool = False) -> None:
        """Runs every worker's actions of ``schedule``; the first failure is raised as it is,
        at once (docs/engine-internals.md#when-an-action-fails). A lone worker runs on the
        calling thread unless ``own_threads`` (the front door's backward: the caller is
        autograd's own thread)."""
        self.mailbox = _reopen(self.mailbox)
        self.split |= {
            (a.stage, a.microbatch) for w in schedule.actions for a in w if a.kind == "W"
        }
        self.w_next |= {
            (b.stage, b.microbatch)
            for w in schedule.actions
            for b, after in zip(w, w[1:])
            if b.kind == "B" and after == Action("W", b.stage, b.microbatch)
        }
        times: list[tuple[float, float]] = []
        lanes = plan_lanes(
            [self.worker_device[w] if acts else None for w, acts in enumerate(schedule.actions)]
        )
        workers = [(acts, lane) for acts, lane in zip(schedule.actions, lanes) if lane is not None]
        if self.cuda:
            self.clock = CudaClock(self.cfg.devices)
            self.cuda_actions.clear()  # a failed phase's marks are never read
            first = len(self.timings)
            join_from_caller(lanes)
        try:
            self._start_workers(workers, times, own_threads)
        except BaseException:
            self.mailbox.abort()  # failed, or the caller was interrupted: the others stop too
            raise
        finally:
            if self.cuda:
                join_to_caller(lanes)
        if self.cuda:
            self._read_cuda_clock()
            times = [(t.start, t.end) for t in self.timings[first:]]
        if times:
            self.span += max(e for _, e in times) - min(s for s, _ in times)
        for stage, waited in enumerate(self.waited):
            self.busy[stage] -= waited
            self.waited[stage] = 0.0

    def _start_workers(
        self,
        workers: Sequence[tuple[Sequence[Action], Lane]],
        times: list[tuple[float, float]],
        own_threads: bool,
    ) -> None:
        if len(workers) == 1 and not own_threads:
            self._work(*workers[0], times, own_thread=False)
            return
        if interleaves(needs_threads=own_threads and self.cuda):  # profiled: see profiling.py
            last = len(self.cfg.stages) - 1 if self.cfg.loss is not None else None
            ready = partial(arrived, mailbox=self.mailbox, last_with_loss=last)
            return interleave(workers, ready, lambda a, lane: self._work((a,), lane, times, False))
        pool = self.pool if self.pool is not None else WorkerPool()
        tasks = [partial(self._work, acts, lane, times, True) for acts, lane in workers]
        pool.run(tasks, self.cfg.timeout)
        if pool is not self.pool:
            pool.close()  # a one-off pool leaves no thread behind

    def _work(
        self,
        actions: Sequence[Action],
        lane: Lane,
        times: list[tuple[float, float]],
        own_thread: bool,
    ) -> None:
        start = time.perf_counter()
        box = self.mailbox
        action = actions[0]
        try:
            with self._worker_context(own_thread, lane):
                for action in actions:
                    if box.aborted:  # another worker failed: stop before the next action
                        return
                    self._act(action)
        except Aborted:
            return  # woken by another worker's failure, which that worker reports
        except BaseException as exc:
            box.abort()
            note_failure(exc, action, self.cfg.devices[action.stage])
            raise
        finally:
            times.append((start, time.perf_counter()))

    def _act(self, action: Action) -> None:
        stage = action.stage
        waited, replayed = self.waited[stage], self.recomputed[stage]
        received, kept = self.received[stage], self.kept[stage]
        device = self.cfg.devices[stage]
        marks = None
        if self.clock is not None and device.type == "cuda":
            marks = self.cuda_marks[stage] = [self.clock.mark(device)]
        t0 = time.perf_counter()
        with profiled(action):
            if action.kind == "F":
                self.forward(stage, action.microbatch)
            elif action.kind == "B":
                self.backward(stage, action.microbatch)
            elif action.kind == "W":
                self.weight(stage, action.microbatch)
            else:
                raise ValueError(f"the local executor cannot run action {action}")
        t1 = time.perf_counter()
        self.busy[stage] += t1 - t0
        if marks is not None and self.clock is not None:
            marks.append(self.clock.mark(device))
            self.cuda_marks[stage] = None
            self.cuda_actions.append((len(self.timings), marks))
        self.timings.append(
            ActionTiming(
                action,
                t0,
                t1,
                self.waited[stage] - waited,
                self.recomputed[stage] - replayed,
                self.received[stage] - received,
                self.kept[stage] - kept,
            )
        )

    @contextmanager
    def _worker_context(self, own_thread: bool, lane: Lane) -> Iterator[None]:
        # Worker threads start with grad mode on, autocast off and all cores; give them the
        # caller's state, and one share of the cores each so stages don't oversubscribe. A
        # pooled thread gets its own core count back after the phase, as if it were fresh.
        # On the caller's thread too (a lone worker, a distributed rank): the worker's device
        # and stream, and its backward on this very thread, both undone when the phase ends
        # (docs/engine-internals.md#each-backward-on-its-workers-thread).
        with ExitStack() as stack:
            if own_thread and self.cfg.threads_per_worker:
                stack.callback(torch.set_num_threads, torch.get_num_threads())
                torch.set_num_threads(self.cfg.threads_per_worker)
            enter_lane(stack, lane)
            stack.enter_context(backward_here())
            stack.enter_context(torch.set_grad_enabled(self.cfg.grad_enabled))
            for device_type, dtype in self.cfg.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield

    # ---- actions ---------------------------------------------------------------------------

    def forward(self, stage: int, m: int) -> None:
        """F(stage, m): run the stage on micro-batch m and hand the result on."""
        cfg = self.cfg
        device = cfg.devices[stage]
        x = self._take(stage, ("act", stage, m))
        train = cfg.grad_enabled
        leaves = make_leaves(x, first=stage == 0) if train else x
        recompute_later = train and m < cfg.recompute_stop
        with rng_context(cfg.seed, m, device):
            if not train:
                y = self._run_stage(stage, leaves, m)
            elif recompute_later:
                with torch.no_grad():
                    y = self._run_stage(stage, leaves, m)
            else:
                y, saved = self._run_saving(stage, leaves, m)
        if train:
            self.leaves[stage][m] = leaves
            if not recompute_later:
                self.outputs[stage][m] = y
            self._hold(stage, m, nbytes(leaves) + (0 if recompute_later else saved))
        self._hand_on(stage, m, y)

    def _run_saving(self, stage: int, leaves: Any, m: int) -> tuple[Any, int]:
        """Runs the stage for backward; returns its output and the bytes autograd saved.

        Metered on the first micro-batch of each input layout, per stage and step, and taken
        as the same for the others: the meter's hooks cost a Python call per saved tensor,
        about 5% of a step on small layers (a Transformer of width 128). Saved bytes that
        depend on the values, not the layout (data-dependent shapes inside a stage), are
        therefore those of the step's first micro-batch of that layout.

        A stage whose forward updates its buffers in place (BatchNorm's running statistics)
        keeps its saved tensors as aliases on every micro-batch (:func:`saved_as_aliases`):
        autograd would otherwise refuse the backward of a micro-batch whose saved buffer a
        later micro-batch's forward has updated. The first micro-batch tells which stages do.
        """
        module = self.cfg.stages[stage]
        key = (stage, _layout(leaves))
        known = self.saved_bytes.get(key)
        if known is not None:
            with saved_as_aliases() if self.updates_buffers[stage] else nullcontext():
                return self._run_stage(stage, leaves, m), known
        meter = SavedTensorMeter(storages=self._parameter_storages(stage))
        meter.ignore(as_tuple(leaves))  # counted once, as held inputs
        before = _buffer_versions(module)
        with meter:
            y = self._run_stage(stage, leaves, m)
        self.updates_buffers[stage] |= _buffer_versions(module) != before
        self.saved_bytes[key] = meter.bytes
        return y, meter.bytes

    def _parameter_storages(self, stage: int) -> frozenset[int]:
        # Once per stage and step: the parameters cannot move while a step runs.
        found = self.param_storages[stage]
        if found is None:
            found = self.param_storages[stage] = storage_keys(self.cfg.stages[stage].parameters())
        return found

    def _run_stage(self, stage: int, x: Any, m: int) -> Any:
        y = _checked_output(stage, self.cfg.stages[stage](x))
        loss = self.cfg.loss
        if loss is not None and stage == len(self.cfg.stages) - 1:
            target = to_device(loss.targets[m], self.cfg.devices[stage])
            return scale_gradient(loss.fn(y, target) * loss.scales[m], loss.loss_scale)
        return y

    def _hand_on(self, stage: int, m: int, y: Any) -> None:
        if stage == len(self.cfg.stages) - 1:
            if self.cfg.loss is not None:
                self.losses[m] = y.detach()
            else:
                self.results[m] = detach(y)
            return
        self.post(("act", stage + 1, m), detach(y))

    def backward(self, stage: int, m: int) -> None:
        """B(stage, m): backward of the stage for micro-batch m, gradient to the previous one."""
        cfg = self.cfg
        leaves = self.leaves[stage].pop(m)
        if m < cfg.recompute_stop:
            t0 = time.perf_counter()
            self._cuda_mark(stage, "recompute")
            with rng_context(cfg.seed, m, cfg.devices[stage]), recomputing(cfg.stages[stage]):
                y, saved = self._run_saving(stage, leaves, m)
            self._hold(stage, m, saved)
            self.recomputed[stage] += time.perf_counter() - t0
            self._cuda_mark(stage, "recompute")
        else:
            y = self.outputs[stage].pop(m)
        tensors: list[torch.Tensor]
        grads: list[torch.Tensor | None]
        if stage == len(cfg.stages) - 1 and cfg.loss is not None:
            tensors, grads = [y], [None]
        else:
            received = as_tuple(self._take(stage, ("grad", stage, m)))
            tensors, grads = pair_gradients(as_tuple(y), received, cfg.devices[stage])
        if (stage, m) in self.split and not self._whole_backward_now(stage, m, leaves):
            # Zero bubble: input gradients now, the graph kept for W (recompute done once).
            input_grads, pending = _backward_input(tensors, grads, leaves, cfg.stages[stage])
            self.pending[stage][m] = pending
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            input_grads = tuple(
                t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                for t in as_tuple(leaves)
            )
            if (stage, m) in self.split:
                self.pending[stage][m] = None  # the W that follows has nothing left to do
            self._release(stage, m)
        del y, tensors, grads
        if stage == 0:
            self.input_grads[m] = input_grads
        else:
            self.post(("grad", stage - 1, m), input_grads)

    def _whole_backward_now(self, stage: int, m: int, leaves: Any) -> bool:
        """Whether a split B had better run the whole backward: the split lets a B hand its
        input gradient on before W runs; where none is handed on (stage 0's data needs none)
        and W is the worker's very next action, it gains nothing and costs a walk of the graph
        and an autograd call per parameter group (the W left then only releases the graph)."""
        if (stage, m) not in self.w_next:
            return False
        return not any(isinstance(t, torch.Tensor) and t.requires_grad for t in as_tuple(leaves))

    def weight(self, stage: int, m: int) -> None:
        """W(stage, m): parameter gradients of a split backward; then the graph is released."""
        pending = self.pending[stage].pop(m)
        if pending is not None:
            pending.run()
        del pending
        self._release(stage, m)

    def _receive(self, stage: int, key: tuple[str, int, int]) -> Any:
        # Waiting is idle time, not work: keep it out of the stage's busy time.
        t0 = time.perf_counter()
        self._cuda_mark(stage, "wait")
        try:
            value = self.mailbox.get(key)
        finally:
            self.waited[stage] += time.perf_counter() - t0
            self._cuda_mark(stage, "wait")
        self.received[stage] += nbytes(value)
        return value

    def _take(self, stage: int, key: tuple[str, int, int]) -> Any:
        """The value of ``key`` on the stage's device, for this worker's stream."""
        return self._arrive(self._receive(stage, key), self.cfg.devices[stage], key)

    def _arrive(self, value: Any, device: torch.device, key: tuple[str, int, int]) -> Any:
        if self.copies is None:
            return to_device(value, device)
        # Waits for the producer's event of this value only (recorded by post()).
        return self.copies.arrive(value, device, self.ready.pop(key, None))

    # ---- CUDA time ---------------------------------------------------------------------

    def _cuda_mark(self, stage: int, what: str) -> None:
        # Pairs of ("wait" | "recompute", event) inside the running action of ``stage``.
        marks = self.cuda_marks[stage]
        if marks is not None and self.clock is not None:
            marks.append((what, self.clock.mark(self.cfg.devices[stage])))

    def _read_cuda_clock(self) -> None:
        """The phase's CUDA actions as their streams ran them: start and end from the events
        around the action, ``waited`` the stream idle between the events around each wait
        (not the host's wait, which overlaps kernels still running), ``recompute`` likewise."""
        assert self.clock is not None
        clock = self.clock
        ends = [marks[-1] for _, marks in self.cuda_actions]  # a stream's last mark: all before
        clock.settle(ends, self.cfg.timeout)
        for index, marks in self.cuda_actions:
            old = self.timings[index]
            start, end = clock.seconds(marks[0]), clock.seconds(marks[-1])
            inner = marks[1:-1]
            spans: dict[str, float] = {"wait": 0.0, "recompute": 0.0}
            for (what, a), (_, b) in zip(inner[::2], inner[1::2], strict=True):
                spans[what] += clock.seconds(b) - clock.seconds(a)
            stage = old.action.stage
            self.busy[stage] += (end - start) - (old.end - old.start)
            self.waited[stage] += spans["wait"] - old.waited
            self.recomputed[stage] += spans["recompute"] - old.recompute
            self.timings[index] = replace(
                old, start=start, end=end, waited=spans["wait"], recompute=spans["recompute"]
            )
        self.cuda_actions.clear()
        self.clock = None

    # ---- memory accounting -------------------------------------------------------------

    def _hold(self, stage: int, m: int, added: int) -> None:
        if m not in self.held[stage]:
            self.in_flight[stage] += 1
            self.in_flight_peaks[stage] = max(self.in_flight_peaks[stage], self.in_flight[stage])
        self.held[stage][m] = self.held[stage].get(m, 0) + added
        self.kept[stage] += added
        self.live[stage] += added
        self.peaks[stage] = max(self.peaks[stage], self.live[stage])
        w = self.worker_of[stage]
        self.worker_live[w] += added
        self.worker_peaks[w] = max(self.worker_peaks[w], self.worker_live[w])

    def _release(self, stage: int, m: int) -> None:
        if m in self.held[stage]:
            self.in_flight[stage] -= 1
        released = self.held[stage].pop(m, 0)
        self.live[stage] -= released
        self.worker_live[self.worker_of[stage]] -= released


def _checked_output(stage: int, y: Any) -> Any:
    # torchgpipe's rule at a stage boundary: a tensor or a tuple of tensors (masks, ints or None
    # may ride along); anything else fails here, a TypeError, not somewhere downstream.
    if isinstance(y, torch.Tensor):
        return y
    if isinstance(y, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in y):
        return y
    raise TypeError(
        f"expected Tensor or Tuple[Tensor, ...] from stage {stage}, but got {type(y).__name__}"
    )


def _backward_input(
    tensors: list[torch.Tensor], grads: list[Any], leaves: Any, stage: nn.Module
) -> tuple[tuple[Any, ...], WeightGradient | None]:
    """B of a split backward: the input gradients, and the W that completes it."""
    if not tensors:
        return tuple(None for _ in as_tuple(leaves)), None
    return backward_input(tensors, grads, as_tuple(leaves), stage.parameters())


def _reopen(box: Mailbox) -> Mailbox:
    # A phase after a failed phase must not inherit the abort flag; live items carry over.
    if not box.aborted:
        return box
    fresh = Mailbox(box.timeout)
    fresh._items = box._items  # noqa: SLF001
    return fresh


def _layout(value: Any) -> tuple[Any, ...]:
    """What decides the bytes a stage saves for backward, up to data-dependent shapes: each
    input tensor's shape, dtype and whether it needs a gradient.

    >>> _layout((torch.ones(2, 3), 5))
    ((torch.Size([2, 3]), torch.float32, False), <class 'int'>)
    """
    return tuple(
        (t.shape, t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else type(t)
        for t in as_tuple(value)
    )


def _buffer_versions(module: nn.Module) -> list[int]:
    """The version counters of a module's buffers: they move when a forward updates one.

    BatchNorm's running statistics are left out: BatchNorm updates them in every training
    forward, and autograd accepts that (forwards of several batches before their backwards
    work in plain PyTorch); a recompute restores them without a version change
    (giantpipe.engine.recompute).
    """
    skip = {
        id(b)
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for b in m.buffers(recurse=False)
    }
    return [b._version for b in module.buffers() if id(b) not in skip]  # noqa: SLF001
