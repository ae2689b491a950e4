"""Where the time and memory of a step went, measured on every step.

Busy time per worker, the step's span and its bubble; memory as the saved activations
(:class:`SavedTensorMeter`) or the CUDA allocator's peak; CUDA actions timed by events
(:class:`CudaClock`): docs/engine-internals.md#measured-time-and-memory.

Example::

    >>> s = StepStats.from_timings(wall=1.0, span=1.0, busy=[0.6, 0.8], peaks=[10, 20],
    ...                            chunks=4, memory_kind="saved_activations")
    >>> round(s.bubble, 2), round(s.expected_bubble, 2)
    (0.3, 0.2)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

import torch

from giantpipe.engine.failures import PipelineTimeout
from giantpipe.engine.schedules.actions import Action
from giantpipe.engine.schedules.fill_drain import expected_bubble


@dataclass(frozen=True)
class ActionTiming:
    """One action as the executor ran it: ``start`` and ``end`` on ``time.perf_counter``'s
    clock, ``waited`` of it spent waiting for a neighbour's activation or gradient, and
    ``recompute`` of it spent re-materializing the forward (a B of a re-materialized
    micro-batch); ``received`` bytes it took from its neighbour (the activation of an F, the
    gradient of a B) and ``kept`` bytes it added to what the stage holds for backward (an F:
    its input and, unless re-materialized, the activations autograd saves; a recompute: those
    activations again). A distributed forecast is built from them
    (:func:`giantpipe.perf.predict.costs_from_timings`)."""

    action: Action
    start: float
    end: float
    waited: float = 0.0
    recompute: float = 0.0
    received: int = 0
    kept: int = 0

    @property
    def work(self) -> float:
        """Seconds of the action spent working (waiting left out)."""
        return self.end - self.start - self.waited


@dataclass(frozen=True)
class StepStats:
    """Measurements of one pipelined step (forward + backward)."""

    wall_time_s: float  # as seen by the caller, scatter and gather included
    span_s: float  # first action start to last action end (excludes the user's loss, front door)
    busy_time_s: list[float]  # per worker: time spent running its actions
    bubble: float  # measured idle fraction: 1 - sum(busy) / (K * span)
    expected_bubble: float  # (K-1)/(V*M+K-1)
    peak_memory_bytes: list[int]  # per worker; see memory_kind
    memory_kind: str  # "cuda_allocator" or "saved_activations" (bytes saved for backward)
    # (saved_activations on CUDA too where workers share a device; see memory_kind())
    chunks: int
    clock: str = "perf_counter"  # "cuda_events" where the stages ran on CUDA (CudaClock)
    # per worker: the part of busy time spent re-materializing forwards (the paper's Section
    # 3.1 breakdown: recompute share, imbalance and bubble are all read off one step)
    recompute_time_s: list[float] = field(default_factory=list)

    @classmethod
    def from_timings(
        cls,
        wall: float,
        span: float,
        busy: list[float],
        peaks: list[int],
        chunks: int,
        memory_kind: str,
        virtual_stages: int = 1,
        clock: str = "perf_counter",
        recompute: list[float] | None = None,
    ) -> StepStats:
        """Statistics of K workers (one entry of ``busy``, ``peaks`` and ``recompute`` each)
        over a step."""
        k = len(busy)
        bubble = 1.0 - sum(busy) / (k * span) if span > 0 else 0.0
        return cls(
            wall_time_s=wall,
            span_s=span,
            busy_time_s=list(busy),
            bubble=max(0.0, bubble),
            expected_bubble=expected_bubble(k, chunks, virtual_stages),
            peak_memory_bytes=list(peaks),
            memory_kind=memory_kind,
            chunks=chunks,
            clock=clock,
            recompute_time_s=list(recompute) if recompute is not None else [0.0] * k,
        )

    @classmethod
    def from_table(
        cls,
        table: torch.Tensor,
        chunks: int,
        memory_kind: str,
        virtual_stages: int = 1,
        clock: str = "perf_counter",
    ) -> StepStats:
        """Statistics from one row per worker, ``[wall, span, busy, peak bytes, recompute]``
        (recompute optional): what the distributed executor's ranks all-gather (the slowest
        rank's wall and span count).

        >>> table = torch.tensor([[0.61, 0.60, 0.52, 3e7, 0.1], [0.61, 0.58, 0.53, 2e7, 0.2]])
        >>> stats = StepStats.from_table(table, 4, "saved_activations")
        >>> stats.peak_memory_bytes, [round(r, 2) for r in stats.recompute_time_s]
        ([30000000, 20000000], [0.1, 0.2])
        """
        return cls.from_timings(
            wall=float(table[:, 0].max()),
            span=float(table[:, 1].max()),
            busy=table[:, 2].tolist(),
            peaks=[int(p) for p in table[:, 3].tolist()],
            chunks=chunks,
            memory_kind=memory_kind,
            virtual_stages=virtual_stages,
            clock=clock,
            recompute=table[:, 4].tolist() if table.shape[1] > 4 else None,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- memory: bytes saved for backward, the allocator's peak --------------------------------
def storage_keys(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The storages of ``tensors``, as :class:`SavedTensorMeter` tells them apart.

    >>> from torch import nn
    >>> layer = nn.Linear(2, 2)
    >>> len(storage_keys(layer.parameters()))
    2
    """
    keys = set()
    for t in tensors:
        try:
            keys.add(t.untyped_storage().data_ptr())
        except RuntimeError:  # a DTensor (a rank's FSDP2 shard) has no storage of its own
            continue
    return frozenset(keys)


class SavedTensorMeter:
    """Context manager that sums the bytes of distinct storages saved for backward.

    Relies on ``torch.autograd.graph.saved_tensors_hooks``, which is thread-local, so each
    pipeline worker meters only its own stage.

    >>> from torch import nn
    >>> layer = nn.Linear(256, 256)
    >>> meter = SavedTensorMeter(exclude=layer.parameters())
    >>> with meter:
    ...     y = layer(torch.randn(8, 256, requires_grad=True)).relu()
    >>> meter.bytes  # the input of the matmul and the ReLU result: 2 x 8 x 256 x 4
    16384
    """

    def __init__(
        self, exclude: Iterable[torch.Tensor] = (), *, storages: frozenset[int] = frozenset()
    ) -> None:
        # ``storages``: keys of tensors to exclude (:func:`storage_keys`), computed once for
        # the many meters of a stage (walking a module's parameters costs more than a layer).
        self._exclude = storages | storage_keys(exclude)
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def ignore(self, tensors: Iterable[object]) -> None:
        """Treats the storages of ``tensors`` as already counted (e.g. stage inputs)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._seen.add(t.untyped_storage().data_ptr())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Views share a storage; count each storage once. Meta and fake tensors have no data.
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._exclude and key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        # Keep a detached alias (same storage and version counter, no grad_fn), not the tensor:
        # a saved output held by its own node through a hook is a cycle through C++ that
        # Python's collector cannot see, so a graph retained for a later weight-gradient (W)
        # would never be freed. (Double backward through metered code is not supported.)
        return tensor.detach()

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)


def saved_as_aliases() -> torch.autograd.graph.saved_tensors_hooks:
    """What :class:`SavedTensorMeter` does to saved tensors, without the metering.

    Saved tensors are kept as detached aliases, as under the meter, so that autograd behaves
    the same with or without it: in particular it does not check the versions of hooked saved
    tensors, and a pipeline runs several forwards before their backwards, during which a layer
    may update a saved buffer in place (BatchNorm's running statistics). Both hooks are
    ``Tensor.detach`` itself, with no Python frame per saved tensor.

    Example::

        with saved_as_aliases():
            loss = stage(x).sum()
    """
    return torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, torch.Tensor.detach)


def _unpack(tensor: Any) -> Any:
    return tensor


class CudaClock:
    """Times a phase's actions on CUDA devices with events, read back onto ``perf_counter``.

    A phase starts with one event per CUDA device, paired with the host clock when it is
    recorded; every later event on that device converts to host seconds through that pair.
    Nothing waits for the device there: a synchronize at every phase would stop the host from
    running ahead, and behind an NCCL operation whose peer died it would never return. The pair
    is exact when the stream is idle as the phase starts (a step's end waits for the device, so
    it is between steps); otherwise the whole phase's timeline shifts, but its durations (busy,
    waits, recompute, span) are differences of events and stay exact. Events are recorded on the
    calling thread's current stream (the worker's, which its thread entered:
    :mod:`giantpipe.engine.streams`), so they complete when the stage's kernels before them have
    run, not when they were launched. :meth:`settle` waits for them, under a deadline.

    Example (on a GPU)::

        clock = CudaClock([torch.device("cuda:0")])
        start = clock.mark(torch.device("cuda:0"))
        y = layer(x)                                   # returns at once; the kernels run later
        end = clock.mark(torch.device("cuda:0"))
        clock.settle(timeout=60.0)                     # every mark reached, or PipelineTimeout
        clock.seconds(end) - clock.seconds(start)      # the kernels' time, after they ran
    """

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self._base: dict[torch.device, tuple[torch.cuda.Event, float]] = {}
        for device in {d for d in devices if d.type == "cuda"}:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self._base[device] = (event, time.perf_counter())

    def mark(self, device: torch.device) -> tuple[torch.device, torch.cuda.Event]:
        """An event recorded now on ``device``'s current stream (of the calling thread)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return device, event

    def settle(self, marks: Iterable[tuple[torch.device, Any]], timeout: float) -> None:
        """Waits until every event of ``marks`` has completed, polling; raises
        :class:`~giantpipe.engine.failures.PipelineTimeout` after ``timeout`` seconds (a stream
        stuck behind a lost peer's operation) rather than blocking for ever."""
        bases = [event for event, _ in self._base.values()]
        settle_events(bases + [event for _, event in marks], timeout, "the stages' kernels")

    def seconds(self, mark: tuple[torch.device, torch.cuda.Event]) -> float:
        """When the stream reached ``mark``, on the host's ``perf_counter`` clock (``mark``
        must have completed: :meth:`settle`)."""
        device, event = mark
        base, host = self._base[device]
        return host + base.elapsed_time(event) / 1e3


def settle_events(events: Sequence[Any], timeout: float, what: str) -> None:
    """Polls ``events`` (anything with ``query()``) until all have completed, sleeping a little
    longer each time; raises PipelineTimeout naming ``what`` after ``timeout`` seconds.

    >>> class Done:
    ...     def query(self) -> bool:
    ...         return True
    >>> settle_events([Done(), Done()], timeout=1.0, what="two kernels")
    """
    deadline = time.monotonic() + timeout
    pause = 1e-5
    for event in events:
        while not event.query():
            if time.monotonic() >= deadline:
                raise PipelineTimeout(f"{what} did not finish on the device within {timeout:g}s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-2)


def memory_kind(worker_devices: Sequence[torch.device]) -> str:
    """What a step's per-worker peak memory can honestly be: ``"cuda_allocator"`` (the
    allocator's peak of each worker's device) where every worker has a CUDA device of its own,
    else ``"saved_activations"`` (each worker's bytes saved for backward). The allocator counts
    per device: workers sharing one would each report the device's peak, every stage's memory.

    >>> memory_kind([torch.device("cuda:0"), torch.device("cuda:1")])
    'cuda_allocator'
    >>> memory_kind([torch.device("cuda:0"), torch.device("cuda:0")])
    'saved_activations'
    """
    devices = list(worker_devices)
    own = len(set(devices)) == len(devices)
    if own and all(d.type == "cuda" for d in devices):
        return "cuda_allocator"
    return "saved_activations"


def reset_device_peak(device: torch.device) -> None:
    """Resets the CUDA allocator's peak counter (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak(device: torch.device) -> int:
    """The CUDA allocator's peak bytes since the last reset (0 on other devices)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return 0
