"""PipelineSpec: a pipeline's shape as one frozen value, checked once.

Balance, M, V, the schedule, the re-materialization mode, the devices and the timeout have one
owner, from the config or the planner to the pipes and the cost model:

    PipelineConfig --pipeline_spec()--> PipelineSpec --spec=--> GPipe / DistributedPipe
    planner's best candidate --.spec()--^                  pipe.spec --> perf (predict, ...)

A spec checks everything it can without the model when it is made (``__post_init__``) and builds
and validates its schedule there, once; a pipe adds only what needs the model (the balance's sum)
and the devices. Messages start with the config key a runner user would change, e.g.
``pipeline.chunks: ...``, and keep torchgpipe's wording after it. The defaults of both pipes and
of the config's ``pipeline`` group are the ones here.

Imports no torch (the schedules are plain data): the config's schema refers to the defaults.

Example::

    >>> spec = PipelineSpec(balance=(2, 2), chunks=4, schedule="1f1b")
    >>> spec.num_workers, spec.virtual_stages, spec.recompute
    (2, 1, 'except_last')
    >>> [str(a) for a in spec.step_schedule().actions[1]][:3]
    ['F0@1', 'B0@1', 'F1@1']
    >>> try:
    ...     PipelineSpec(balance=(2, 2), chunks=0)
    ... except SpecError as err:
    ...     print(err)
    pipeline.chunks: number of chunks must be positive integer (chunks: 0)

A pipe takes one (``GPipe(model, spec=spec)``) or makes one from its keyword arguments.
"""

from __future__ import annotations

import dataclasses
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
MAX_CHUNKS = 2**20
"""More micro-batches than this is a typo, not a plan: refused before a schedule is built."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest timeout: a wait longer than a week is a typo (and past
``threading.TIMEOUT_MAX`` a worker thread could not even wait that long)."""


class SpecError(ValueError):
    """A bad pipeline setting; ``key`` is the config key that sets it (``pipeline.chunks``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline's shape; every field is checked when the spec is made."""

    balance: tuple[int, ...]
    """Layers per stage: K*V entries (K workers, V stages each). Empty: the identity pipe."""
    chunks: int = DEFAULT_CHUNKS
    """M, micro-batches per mini-batch."""
    schedule: str = DEFAULT_SCHEDULE
    """The schedule ``train_step`` runs: gpipe, 1f1b, interleaved, zb-h1 or zb-v."""
    virtual_stages: int = 0
    """V, stages per worker; 0 or None (the default): 2 for interleaved and zb-v, else 1."""
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
        set_(self, "balance", check_balance(self.balance))
        set_(self, "chunks", check_chunks(self.chunks))
        set_(self, "recompute", check_recompute(self.recompute, "pipeline.recompute"))
        set_(self, "virtual_stages", check_virtual_stages(self))
        set_(self, "timeout", check_timeout(self.timeout))
        if self.devices is not None:
            set_(self, "devices", tuple(self.devices))
        if self.threads_per_worker is not None and not self.threads_per_worker >= 1:
            raise SpecError("threads_per_worker", f"must be >= 1, got {self.threads_per_worker}")
        set_(self, "_schedule", build(self))

    @property
    def num_workers(self) -> int:
        """K: workers (devices, or pipeline ranks) of the pipeline."""
        return len(self.balance) // self.virtual_stages

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
            changes["virtual_stages"] = 0  # inferred again for the new schedule
        return dataclasses.replace(self, **changes)


def check_balance(balance: Iterable[int] | None) -> tuple[int, ...]:
    """The balance as a tuple of positive ints (torchgpipe's messages).

    >>> check_balance([2, 3])
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
            "pipeline.balance", f"all balance numbers must be positive integer (balance: {counts})"
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
            "pipeline.chunks", f"number of chunks must be positive integer (chunks: {chunks})"
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
        raise SpecError(key, f"must be one of 'always', 'except_last' or 'never', got {mode!r}")
    return str(mode)


def check_virtual_stages(spec: PipelineSpec) -> int:
    """V: as given, else 2 for 'interleaved' and 'zb-v', 1 otherwise; K*V must be the
    balance's length."""
    v = spec.virtual_stages or VIRTUAL_STAGES.get(spec.schedule, 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise SpecError("pipeline.virtual_stages", f"must be a positive integer, got {v!r}")
    if len(spec.balance) % v:
        raise SpecError(
            "pipeline.virtual_stages",
            f"with virtual_stages={v}, balance must list K*V stages (a multiple of {v}); "
            f"got {len(spec.balance)} entries",
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
        return build_schedule(spec.schedule, spec.num_workers, spec.chunks, spec.virtual_stages)
    except ValueError as err:
        raise SpecError("pipeline.schedule", str(err)) from err
