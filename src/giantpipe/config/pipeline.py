"""How the model is cut into stages and scheduled: the ``pipeline`` group's schema.

The keys of the pipeline's shape (``balance`` when listed, ``chunks``, ``schedule``,
``virtual_stages``, ``recompute``, ``timeout``, ``deferred_batch_norm``) take their defaults and
checks from :class:`~giantpipe.engine.spec.PipelineSpec`, whose ``SpecError`` becomes the key's
:class:`ConfigError` (docs/pipeline-spec.md#who-checks-what). The rest is the runner's: the
executor, the build, the replicas' sharding, the devices as named on the command line, a balance
policy, precision, the planner, capture.

    >>> try:
    ...     PipelineConfig(chunks=0)
    ... except ConfigError as err:
    ...     print(err)
    pipeline.chunks: must be >= 1, got 0
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from giantpipe.config.checks import ConfigError, check, check_choice, check_fields_finite, check_min

# The shape's defaults, limits and field checks are the engine's own (one owner,
# giantpipe.engine.spec, which imports no torch); this schema calls them.
from giantpipe.engine.spec import (
    DEFAULT_CHUNKS,
    DEFAULT_RECOMPUTE,
    DEFAULT_REPLICA_SHARDING,
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT,
    MAX_TIMEOUT_S,
    SpecError,
    check_chunks,
    check_layer_counts,
    check_recompute,
    check_replica_sharding,
    check_timeout,
    check_virtual_stages,
)

__all__ = ["MAX_TIMEOUT_S", "PipelineConfig", "as_config_error"]

BALANCE_POLICIES = ("time", "memory", "params")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_KEYWORDS = ("auto", "cpu", "cuda")
PLAN_MODES = ("auto",)

EXECUTORS = ("local", "distributed")
BUILDS = ("meta", "host")


@contextmanager
def as_config_error() -> Iterator[None]:
    """A :class:`~giantpipe.engine.spec.SpecError` raised inside becomes the ConfigError of its
    key, in the config's words (``pipeline.chunks: must be >= 1, got 0``).

    Example::

        with as_config_error():
            check_chunks(0)         # ConfigError: pipeline.chunks: must be >= 1, got 0
    """
    try:
        yield
    except SpecError as err:
        raise ConfigError(err.key, err.problem) from err


@dataclass
class PipelineConfig:
    """How the model is cut into stages and scheduled (the engine's GPipe arguments)."""

    executor: str = "local"
    """``local``: one process, a worker thread per stage. ``distributed``: one process per
    stage under torchrun (``torchrun --nproc_per_node=K train.py pipeline.executor=distributed``;
    K pipeline ranks x R replicas = the world size, see giantpipe.runner.pipeline)."""
    build: str = "meta"
    """How the model is built: ``meta`` (its parameters on the meta device, then each process
    makes only the layers it holds real, each filled by the model's own init under a seed of
    (trainer.seed, layer): no process ever holds the whole model, and the weights are the same
    whatever the layout) or ``host`` (built whole on each process's host as its constructor
    makes it, then cut: for a model that cannot be built on meta, e.g. one that reads data or
    calls ``.item()`` in ``__init__``)."""
    replica_sharding: str = DEFAULT_REPLICA_SHARDING
    """With R > 1 replicas under torchrun, how each stage is spread over its replicas, on
    torch's FSDP2: ``grads`` (ZeRO-2, the default: each rank holds 1/R of its stage's
    parameters, gradients and optimizer state between steps, so the state that fits grows with
    K x R devices, and gathers each unit once a step), ``full`` (ZeRO-3: the same at rest, and
    during the step one layer's parameters gathered at a time, for every micro-batch's forward
    and backward: less memory, slower) or ``none`` (every replica holds the whole stage;
    gradients all-reduced). ``plan=auto`` picks the least sharded that fits the memory budget.
    Gradients are reduced once per step, after each stage's last backward; on GPUs
    ``precision`` bf16/fp16 also gathers the parameters in that type and reduces the gradients
    in float32."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds any wait for another stage (a worker thread, or another rank under torchrun) may
    take before the step fails."""
    devices: Any = "auto"
    """``auto`` (all visible GPUs, else CPU stand-ins), ``cpu``, ``cuda`` or a list of names."""
    num_devices: int | None = None
    """How many devices: CPU stand-ins to create, or the first N GPUs / listed devices.
    Null: all GPUs / listed devices; CPU stand-ins: one per stage of a listed balance, else 2."""
    balance: Any = "params"
    """Layers per stage (a list summing to the model's length) or ``time``/``memory``/``params``."""
    chunks: int = DEFAULT_CHUNKS
    """M, micro-batches per mini-batch (the pipeline groups set it: cpu_k2 4, auto 32)."""
    recompute: str = DEFAULT_RECOMPUTE
    """Re-materialization mode: ``always``, ``except_last`` or ``never``; the engine's
    ``recompute`` (PipelineSpec.recompute; saving runs: ``trainer.checkpoint_every``)."""
    deferred_batch_norm: bool = False
    """Accumulate BatchNorm running statistics once per mini-batch instead of per micro-batch."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16``: autocast to that type around each engine step and
    evaluation. ``fp16`` (GPUs without bf16: V100, T4) also scales the loss with a gradient
    scaler whose inf/NaN verdict every rank shares: a step whose gradients overflowed is skipped
    and the scale halved (its state is checkpointed)."""
    schedule: str = DEFAULT_SCHEDULE
    """Schedule name handed to the engine's ``train_step``."""
    virtual_stages: int | None = None
    """V, model chunks per device: null (the spec's default) is 2 for ``interleaved`` and
    ``zb-v``, else 1; a listed balance has K*V entries."""
    plan: str | None = None
    """Null: use balance, chunks, recompute, schedule and virtual_stages as set. ``auto``: the
    planner (giantpipe.perf.planner) picks those five by simulating every candidate on layer times
    measured on these devices, within memory_budget_gib; the other keys stay as set."""
    memory_budget_gib: float | None = None
    """plan=auto: memory per device in GiB (weights, gradients, optimizer state, activations).
    Null: a GPU's total memory; CPU stand-ins: the machine's RAM shared evenly."""
    split_points: Any = None
    """A model that is not a flat nn.Sequential (model=hf_causal_lm, model=torchvision) is
    captured by giantpipe.sequentialize and cut into pieces where these submodules start (a list
    of names, e.g. [model.layers.2, model.layers.4]); null: at every repeated block (decoder
    layers, residual blocks) and before the head. The balance then counts pieces."""
    output: str | None = None
    """Such a model's output the pipeline ends with, when it returns a dataclass or dict: a
    field name (e.g. logits); null: its only tensor."""

    def __post_init__(self) -> None:
        check_fields_finite(self, "pipeline")
        with as_config_error():  # the shape's rules are the spec's
            check_chunks(self.chunks)
            check_virtual_stages(self.virtual_stages)
            check(
                self.plan is None or self.plan in PLAN_MODES,
                "pipeline.plan",
                f"must be null or auto, got {self.plan!r}",
            )
            if self.memory_budget_gib is not None:
                check(
                    self.memory_budget_gib > 0,
                    "pipeline.memory_budget_gib",
                    f"must be > 0 (GiB per device) or null, got {self.memory_budget_gib}",
                )
            check_recompute(self.recompute, "pipeline.recompute")
            check_choice(self.precision, PRECISIONS, "pipeline.precision")
            # The schedule's name is the spec's to check, when it is made (with the balance);
            # here only its form.
            check(bool(self.schedule), "pipeline.schedule", "must be a non-empty schedule name")
            if self.num_devices is not None:
                check_min(self.num_devices, 1, "pipeline.num_devices")
            self._check_devices()
            self._check_policy_or_counts()
            check_choice(self.executor, EXECUTORS, "pipeline.executor")
            check_choice(self.build, BUILDS, "pipeline.build")
            check_replica_sharding(self.replica_sharding)
            check_timeout(self.timeout)
            self._check_split_points()

    def _check_devices(self) -> None:
        if isinstance(self.devices, str):
            check_choice(self.devices, DEVICE_KEYWORDS, "pipeline.devices")
            return
        ok = isinstance(self.devices, list | tuple) and len(self.devices) > 0
        check(ok, "pipeline.devices", f"must be auto, cpu, cuda or a list; got {self.devices!r}")
        check(
            self.num_devices is None or self.num_devices <= len(self.devices),
            "pipeline.num_devices",
            f"{self.num_devices} exceeds the {len(self.devices)} devices in pipeline.devices",
        )

    def _check_policy_or_counts(self) -> None:
        if isinstance(self.balance, str):
            check_choice(self.balance, BALANCE_POLICIES, "pipeline.balance")
            return
        ok = isinstance(self.balance, list | tuple) and len(self.balance) > 0
        check(ok, "pipeline.balance", f"must be a list or a policy; got {self.balance!r}")
        check_layer_counts(self.balance)

    def _check_split_points(self) -> None:
        if self.split_points is None:
            return
        ok = isinstance(self.split_points, list | tuple) and len(self.split_points) > 0
        ok = ok and all(isinstance(n, str) and n for n in self.split_points)
        check(
            ok,
            "pipeline.split_points",
            f"must be null or a list of submodule names; got {self.split_points!r}",
        )
