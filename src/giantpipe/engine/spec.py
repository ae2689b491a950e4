"""PipelineSpec: a pipeline's shape as one frozen value, checked once.

Balance, M, V, the schedule, the re-materialization mode, the devices and the timeout have this
one owner, from the config or the planner to the pipes and the cost model; what needs the model
is :meth:`PipelineSpec.check_against`. Imports no torch: the config's schema imports it. Who
checks what, where a spec comes from: docs/pipeline-spec.md#who-checks-what.

    >>> spec = PipelineSpec(balance=(2, 2), chunks=4, schedule="1f1b")
    >>> spec.num_workers, spec.virtual_stages, spec.recompute
    (2, 1, 'except_last')
    >>> try:
    ...     PipelineSpec(balance=(2, 2), chunks=0)
    ... except SpecError as err:
    ...     print(err)
    pipeline.chunks: number of chunks must be positive integer (chunks: 0)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from giantpipe.engine.schedules import VIRTUAL_STAGES, build_schedule, schedule_builders
from giantpipe.engine.schedules.actions import Schedule

# One set of defaults, for both pipes and the config's pipeline group.
DEFAULT_CHUNKS = 1
"""M = 1, torchgpipe's default: a pipe made without ``chunks`` runs as torchgpipe's would. Runs
from the command line choose M in their pipeline group (cpu_k2: 4, auto: 32)."""
DEFAULT_RECOMPUTE = "except_last"
"""torchgpipe's default: the last micro-batch's backward follows its forward, so keeping its
activations costs nothing."""
DEFAULT_SCHEDULE = "gpipe"
DEFAULT_TIMEOUT = 300.0
"""Seconds any wait for a neighbour (a worker thread, or another rank) may take. It bounds only
a silent hang (a failure is reported at once), so a long bound costs a failing run nothing, while
a short one (60 s) kills healthy runs whose first step sets up NCCL or runs on loaded CPUs."""
RECOMPUTE_MODES = ("always", "except_last", "never")
REPLICA_SHARDINGS = ("full", "grads", "none")
"""How a stage is spread over its R replicas on FSDP2 (``engine/distributed/replicas.py``): ZeRO-3,
ZeRO-2, replicated. Not the pipeline's shape, but its one owner is here, beside the shape's
rules: the config's schema (no torch) and the distributed pipe check it alike."""
DEFAULT_REPLICA_SHARDING = "grads"
"""ZeRO-2, torchtitan's rule under pipelining (no resharding after forward): between steps each
rank holds 1/R of its stage's parameters, gradients and optimizer state, as ZeRO-3 does, and
gathers each unit once a step rather than for every micro-batch's forward and backward, which
measured about 2x faster (docs/running.md, "Replicas"). ``full`` is the choice for a stage whose
whole parameters and gradients do not fit together; ``pipeline.plan=auto`` makes it where the
memory budget says so."""
MAX_CHUNKS = 2**20
"""More micro-batches than this is a typo, not a plan: refused before a schedule is built."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest timeout: a wait longer than a week is a typo (and past
``threading.TIMEOUT_MAX`` a worker thread could not even wait that long)."""


class SpecError(ValueError):
    """A bad pipeline setting; ``key`` is the config key that sets it (``pipeline.chunks``),
    ``message`` what is wrong in the engine's (torchgpipe's) words, ``problem`` the same in the
    config's words where they differ (the config's ``ConfigError`` carries it).

    >>> err = SpecError("pipeline.chunks", "number of chunks must be positive integer (chunks: 0)",
    ...                 problem="must be >= 1, got 0")
    >>> print(err); print(err.problem)
    pipeline.chunks: number of chunks must be positive integer (chunks: 0)
    must be >= 1, got 0
    """

    def __init__(self, key: str, message: str, problem: str | None = None) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
        self.problem = message if problem is None else problem


class TooFewDevices(SpecError, IndexError):
    """More stages than the devices can hold: an IndexError, as torchgpipe raises it."""


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline's shape; every field is checked when the spec is made."""

    balance: tuple[int, ...]
    """Layers per stage: K*V entries (K workers, V stages each). Empty: the identity pipe."""
    chunks: int = DEFAULT_CHUNKS
    """M, micro-batches per mini-batch."""
    schedule: str = DEFAULT_SCHEDULE
    """The schedule ``train_step`` runs: gpipe, 1f1b, interleaved, zb-h1 or zb-v."""
    virtual_stages: int | None = None
    """V, stages per worker; None (the default): 2 for interleaved and zb-v, else 1 (the spec
    holds the V it runs: never None once made)."""
    recompute: str = DEFAULT_RECOMPUTE
    """Re-materialization: always, except_last or never (GPipe's alias: ``checkpoint=``)."""
    devices: tuple[Any, ...] | None = None
    """The K workers' devices (local executor; ``"cpu"``, ``"cuda:1"``, an index); None: every
    GPU, else CPU stand-ins. A DistributedPipe has one device per rank (its ``device=``)."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds any wait for a neighbour may take before the step fails."""
    threads_per_worker: int | None = None
    """Intra-op threads of each worker thread (local executor); None: CPU stand-ins share the
    caller's evenly. A rank under torchrun keeps its process's own."""
    deferred_batch_norm: bool = False
    """BatchNorm running statistics once per mini-batch rather than per micro-batch."""
    _schedule: Schedule | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are set once, here
        set_(self, "balance", check_layer_counts(self.balance))
        set_(self, "chunks", check_chunks(self.chunks))
        set_(self, "recompute", check_recompute(self.recompute, "pipeline.recompute"))
        v = virtual_stages_of(self.schedule, check_virtual_stages(self.virtual_stages))
        set_(self, "virtual_stages", check_stage_count(self.balance, v))
        set_(self, "timeout", check_timeout(self.timeout))
        if self.devices is not None:
            set_(self, "devices", tuple(self.devices))
        if self.threads_per_worker is not None and not self.threads_per_worker >= 1:
            raise SpecError("threads_per_worker", f"must be >= 1, got {self.threads_per_worker}")
        set_(self, "_schedule", build(self))

    @classmethod
    def from_keywords(
        cls,
        spec: PipelineSpec | None = None,
        *,
        balance: Iterable[int] | None = None,
        chunks: int = DEFAULT_CHUNKS,
        schedule: str = DEFAULT_SCHEDULE,
        virtual_stages: int | None = None,
        recompute: str = DEFAULT_RECOMPUTE,
        checkpoint: str | None = None,
        devices: Iterable[Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        threads_per_worker: int | None = None,
        deferred_batch_norm: bool = False,
    ) -> PipelineSpec:
        """``spec``, or the spec of a pipe's keyword arguments: the one way from keywords to a
        spec (GPipe's and DistributedPipe's doors, the planner's candidates, sizing's settings).
        ``checkpoint`` is torchgpipe's alias of ``recompute`` (GPipe's door passes it on). A
        keyword set beside ``spec`` (not at its default) would be ignored, so it is refused.

        >>> PipelineSpec.from_keywords(balance=[1, 1], chunks=2, checkpoint="never").recompute
        'never'
        >>> PipelineSpec.from_keywords(PipelineSpec((1, 1)), chunks=4)
        Traceback (most recent call last):
        ...
        ValueError: give spec= or chunks, not both
        """
        keywords = {name: value for name, value in locals().items() if name in _KEYWORD_DEFAULTS}
        if spec is not None:
            beside = [k for k, v in keywords.items() if v != _KEYWORD_DEFAULTS[k]]
            if beside:
                raise ValueError(f"give spec= or {', '.join(beside)}, not both")
            return spec
        return cls(
            balance=check_layer_counts(balance),
            chunks=chunks,
            schedule=schedule,
            virtual_stages=virtual_stages,
            recompute=torchgpipe_alias(recompute, checkpoint),
            devices=None if devices is None else tuple(devices),
            timeout=timeout,
            threads_per_worker=threads_per_worker,
            deferred_batch_norm=deferred_batch_norm,
        )

    @property
    def num_workers(self) -> int:
        """K: workers (devices, or pipeline ranks) of the pipeline."""
        return len(self.balance) // virtual_stages_of(self.schedule, self.virtual_stages)

    @property
    def num_stages(self) -> int:
        """K*V stages."""
        return len(self.balance)

    def step_schedule(self) -> Schedule:
        """The schedule ``train_step`` runs, built and validated when the spec was made."""
        if self._schedule is None:
            raise ValueError("an empty pipeline (balance=()) runs no schedule")
        return self._schedule

    def replace(self, **changes: Any) -> PipelineSpec:
        """A new spec with ``changes`` (checked anew).

        >>> PipelineSpec((1, 1), chunks=2).replace(chunks=8).chunks
        8
        """
        if "schedule" in changes and "virtual_stages" not in changes:
            changes["virtual_stages"] = None  # inferred again for the new schedule
        return dataclasses.replace(self, **changes)

    def check_against(self, num_layers: int, num_devices: int | None = None) -> None:
        """What a spec cannot check without the model: its balance covers the model's
        ``num_layers`` layers and, given ``num_devices`` (the workers' devices there are), they
        hold its K*V stages. The one check of a balance against a model, for both pipes and the
        runner (torchgpipe's ValueError / IndexError and messages).

        >>> PipelineSpec((2, 2)).check_against(4, num_devices=2)
        >>> try:
        ...     PipelineSpec((2, 2)).check_against(5)
        ... except SpecError as err:
        ...     print(err.key, "/", err.problem)
        pipeline.balance / [2, 2] sums to 4 but the model has 5 layers
        """
        balance, v = list(self.balance), virtual_stages_of(self.schedule, self.virtual_stages)
        if sum(balance) != num_layers:
            raise SpecError(
                "pipeline.balance",
                "module and sum of balance have different length "
                f"(module: {num_layers}, sum of balance: {sum(balance)})",
                problem=f"{balance} sums to {sum(balance)} but the model has {num_layers} layers",
            )
        if num_devices is not None and len(balance) > num_devices * v:
            per = f" x {v} virtual stages" if v > 1 else ""
            raise TooFewDevices(
                "pipeline.balance",
                "too few devices to hold given partitions "
                f"(devices: {num_devices * v}, partitions: {len(balance)})",
                problem=f"{len(balance)} stages but only {num_devices} devices{per} (see "
                "pipeline.devices, pipeline.num_devices, pipeline.virtual_stages)",
            )


_KEYWORD_DEFAULTS: dict[str, Any] = {
    name: param.default
    for name, param in inspect.signature(PipelineSpec.from_keywords).parameters.items()
    if param.kind is param.KEYWORD_ONLY
}
"""The keywords of :meth:`PipelineSpec.from_keywords` and their defaults (what "not set" is)."""


def torchgpipe_alias(recompute: str, checkpoint: str | None) -> str:
    """The re-materialization mode from ``recompute=`` or torchgpipe's ``checkpoint=`` (its
    alias, refused with torchgpipe's message when it is not a mode).

    >>> torchgpipe_alias("except_last", "never")
    'never'
    """
    if checkpoint is None:
        return recompute
    if str(checkpoint) not in RECOMPUTE_MODES:
        raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
    if recompute != DEFAULT_RECOMPUTE and recompute != checkpoint:
        raise ValueError(f"recompute={recompute!r} and its alias checkpoint={checkpoint!r} differ")
    return str(checkpoint)


def check_layer_counts(balance: Iterable[int] | None) -> tuple[int, ...]:
    """The balance's form: a tuple of positive layer counts (torchgpipe's messages); whether it
    fits a model is :meth:`PipelineSpec.check_against`.

    >>> check_layer_counts([2, 3])
    (2, 3)
    """
    if balance is None:
        raise SpecError(
            "pipeline.balance",
            "balance is required; compute one with giantpipe.perf.balance (balance_by_time, "
            "balance_by_size or balance_by_params)",
        )
    if isinstance(balance, (str, bytes)):
        raise SpecError("pipeline.balance", f"must be a list of layer counts, got {balance!r}")
    counts = list(balance)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in counts):
        raise SpecError(
            "pipeline.balance",
            f"all balance numbers must be positive integer (balance: {counts})",
            problem=f"every stage needs >= 1 layer, got {counts}",
        )
    return tuple(counts)


def check_chunks(chunks: Any) -> int:
    """M as an int: 4 and 4.0 are fine, 4.5, 0 and bools are not.

    >>> check_chunks(4.0)
    4
    """
    whole = isinstance(chunks, int) or (isinstance(chunks, float) and chunks.is_integer())
    if isinstance(chunks, bool) or not whole or chunks <= 0:
        raise SpecError(
            "pipeline.chunks",
            f"number of chunks must be positive integer (chunks: {chunks})",
            problem=f"must be >= 1, got {chunks}" if whole and chunks is not True else None,
        )
    if chunks > MAX_CHUNKS:
        raise SpecError(
            "pipeline.chunks",
            f"must be at most {MAX_CHUNKS} micro-batches per mini-batch, got {int(chunks)}",
        )
    return int(chunks)


def check_recompute(mode: Any, key: str) -> str:
    """The mode as a str (an enum or a config node is fine); ``key`` names it in the message.

    >>> check_recompute("never", "pipeline.recompute")
    'never'
    """
    if str(mode) not in RECOMPUTE_MODES:
        raise SpecError(
            key,
            f"must be one of 'always', 'except_last' or 'never', got {mode!r}",
            problem=f"must be one of {', '.join(RECOMPUTE_MODES)}; got {mode!r}",
        )
    return str(mode)


def check_replica_sharding(mode: Any, key: str = "pipeline.replica_sharding") -> str:
    """The mode as a str, one of :data:`REPLICA_SHARDINGS`; ``key`` names it in the message.

    >>> check_replica_sharding("grads")
    'grads'
    """
    if str(mode) not in REPLICA_SHARDINGS:
        known = ", ".join(REPLICA_SHARDINGS)
        raise SpecError(key, f"must be one of {known}; got {mode!r}")
    return str(mode)


def check_virtual_stages(v: Any) -> int | None:
    """V as given: a positive integer, or None (then the schedule's, :func:`virtual_stages_of`).

    >>> check_virtual_stages(2), check_virtual_stages(None)
    (2, None)
    """
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise SpecError(
            "pipeline.virtual_stages",
            f"must be a positive integer, got {v!r}",
            problem=f"must be >= 1 or null (the schedule's V), got {v!r}",
        )
    return v


def virtual_stages_of(schedule: str, virtual_stages: int | None) -> int:
    """V: as given, else 2 for 'interleaved' and 'zb-v', 1 otherwise.

    >>> virtual_stages_of("interleaved", None), virtual_stages_of("1f1b", None)
    (2, 1)
    """
    return virtual_stages or VIRTUAL_STAGES.get(schedule, 1)


def check_stage_count(balance: tuple[int, ...], v: int) -> int:
    """V, when the balance lists K*V stages (a multiple of V)."""
    if len(balance) % v:
        raise SpecError(
            "pipeline.virtual_stages",
            f"with virtual_stages={v}, balance must list K*V stages (a multiple of {v}); "
            f"got {len(balance)} entries",
        )
    return v


def check_timeout(timeout: Any) -> float:
    """Seconds, positive and at most a week.

    >>> check_timeout(60)
    60.0
    """
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise SpecError("pipeline.timeout", f"must be > 0 seconds, got {timeout}")
    if timeout > MAX_TIMEOUT_S:
        raise SpecError(
            "pipeline.timeout",
            f"must be at most {MAX_TIMEOUT_S:.0f} s (a week), how long a stage may wait for "
            f"another before the step fails; got {timeout}",
        )
    return float(timeout)


def build(spec: PipelineSpec) -> Schedule | None:
    """The spec's schedule, built and validated; None for the empty pipe (whose schedule name
    is still checked)."""
    try:
        if not spec.balance:
            if spec.schedule not in schedule_builders():
                build_schedule(spec.schedule, 1, 1)  # raises, naming the schedules there are
            return None
        v = virtual_stages_of(spec.schedule, spec.virtual_stages)
        return build_schedule(spec.schedule, spec.num_workers, spec.chunks, v)
    except ValueError as err:
        raise SpecError("pipeline.schedule", str(err)) from err
