"""How the model is cut into stages and scheduled: the ``pipeline`` group's schema.

Example::

    from giantpipe.config import PipelineConfig, ConfigError

    PipelineConfig(chunks=8, balance=[2, 3])          # fine
    try:
        PipelineConfig(chunks=0)
    except ConfigError as err:
        print(err)                                    # pipeline.chunks: must be >= 1, got 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from giantpipe.config.checks import check, check_choice, check_fields_finite, check_min

# The pipeline's defaults and limits are the engine's own (one set, giantpipe.engine.spec,
# which imports no torch); this schema only refers to them.
from giantpipe.engine.spec import (
    DEFAULT_CHUNKS,
    DEFAULT_RECOMPUTE,
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT,
    MAX_CHUNKS,
    MAX_TIMEOUT_S,
    RECOMPUTE_MODES,
)

BALANCE_POLICIES = ("time", "memory", "params")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_KEYWORDS = ("auto", "cpu", "cuda")
PLAN_MODES = ("auto",)

EXECUTORS = ("local", "distributed")


@dataclass
class PipelineConfig:
    """How the model is cut into stages and scheduled (the engine's GPipe arguments)."""

    executor: str = "local"
    """``local``: one process, a worker thread per stage. ``distributed``: one process per
    stage under torchrun (``torchrun --nproc_per_node=K train.py pipeline.executor=distributed``;
    K pipeline ranks x R replicas = the world size, see giantpipe.runner.pipeline)."""
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
    virtual_stages: int = 1
    """V, model chunks per device (``interleaved``): a listed balance then has K*V entries."""
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
        check_min(self.chunks, 1, "pipeline.chunks")
        check(
            self.chunks <= MAX_CHUNKS,
            "pipeline.chunks",
            f"must be at most {MAX_CHUNKS} micro-batches per mini-batch, got {self.chunks}",
        )
        check_min(self.virtual_stages, 1, "pipeline.virtual_stages")
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
        check_choice(self.recompute, RECOMPUTE_MODES, "pipeline.recompute")
        check_choice(self.precision, PRECISIONS, "pipeline.precision")
        check(bool(self.schedule), "pipeline.schedule", "must be a non-empty schedule name")
        if self.num_devices is not None:
            check_min(self.num_devices, 1, "pipeline.num_devices")
        self._check_devices()
        self._check_balance()
        self._check_executor()
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

    def _check_balance(self) -> None:
        if isinstance(self.balance, str):
            check_choice(self.balance, BALANCE_POLICIES, "pipeline.balance")
            return
        ok = isinstance(self.balance, list | tuple) and len(self.balance) > 0
        check(ok, "pipeline.balance", f"must be a list or a policy; got {self.balance!r}")
        for count in self.balance:
            check(
                isinstance(count, int) and count >= 1,
                "pipeline.balance",
                f"every stage needs >= 1 layer, got {list(self.balance)}",
            )

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

    def _check_executor(self) -> None:
        check_choice(self.executor, EXECUTORS, "pipeline.executor")
        check(self.timeout > 0, "pipeline.timeout", f"must be > 0 seconds, got {self.timeout}")
        # One cap for both executors: a worker thread cannot wait past threading.TIMEOUT_MAX
        # (its first wait would die of an OverflowError), and a rank silent that long is named.
        check(
            self.timeout <= MAX_TIMEOUT_S,
            "pipeline.timeout",
            f"must be at most {MAX_TIMEOUT_S:.0f} s (a week), how long a stage may wait for "
            f"another before the step fails; got {self.timeout}",
        )
