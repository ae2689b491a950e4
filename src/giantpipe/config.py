"""Experiment configuration: the core groups' schemas, validated in ``__post_init__``.

One dataclass per fixed group (pipeline, optim, trainer, logger, sweep) and the whole experiment.
The ``model`` and ``data`` groups name a builder by ``_target_``; their schemas live in
torch-free ``options`` modules (``models/options.py``'s ``MlpModelConfig``, ...) and are found
from ``conf/`` by ``giantpipe.cli.schemas`` (its lookup rule).
The Hydra tree is converted to these dataclasses once, at the entry point (``giantpipe.cli``);
everything below it receives plain dataclasses and never imports OmegaConf or Hydra.

Every check raises :class:`ConfigError` (the ``check*`` helpers here), whose message starts with
the dotted key, so a user sees ``pipeline.chunks: must be >= 1, got 0`` rather than a stack trace.

Example::

    from giantpipe.config import PipelineConfig, ConfigError

    PipelineConfig(chunks=8, balance=[2, 3])          # fine
    try:
        PipelineConfig(chunks=0)
    except ConfigError as err:
        print(err)                                    # pipeline.chunks: must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

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
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
LR_SCHEDULES = ("constant", "cosine", "exponential", "inverse_sqrt")
PROGRESS_STYLES = ("auto", "tqdm", "none")
WANDB_MODES = ("offline", "online", "disabled")
DIRECTIONS = ("minimize", "maximize")
PLAN_MODES = ("auto",)
SAVE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGCONT")
RESUME_AUTO = "auto"
"""``trainer.resume=auto``: resume where a checkpoint exists, start where none, skip a finished
run (see giantpipe.runner.rundir.resume_point)."""
RESUME_CHECKED = ("trainer.seed", "model", "data")
"""What a resume may not change unless ``trainer.resume_changed`` says the change is meant: the
seed of the batch order, and every key of the model and the data (see
giantpipe.runner.rundir.check_resumed_config)."""

RENAMED_KEYS = {
    "pipeline.checkpoint": "pipeline.recompute",
    "optim.schedule": "optim.lr_schedule",
}
"""Old key -> new key: one word, one meaning (a checkpoint is a saved run; a schedule without
``lr_`` is the pipeline's). The entry point answers an old key with the new one."""


class ConfigError(ValueError):
    """A configuration value is invalid; ``key`` is the dotted key that names it.

    Example::

        raise ConfigError("trainer.max_steps", "must be >= 1, got 0")
    """

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def check(ok: bool, key: str, problem: str) -> None:
    """Raise ``ConfigError(key, problem)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, problem)


def check_choice(value: object, choices: tuple[str, ...], key: str) -> None:
    """``value`` is one of ``choices``."""
    check(value in choices, key, f"must be one of {', '.join(choices)}; got {value!r}")


def check_min(value: float, low: float, key: str) -> None:
    """``value >= low``."""
    check(value >= low, key, f"must be >= {low}, got {value}")


FP32_MAX = 3.4028234663852886e38


def check_finite(value: Any, key: str) -> None:
    """Every float in ``value`` (a number, or lists and mappings of them) is finite: ``nan`` and
    ``inf`` are never a setting, and any other check would refuse them for the wrong reason.

    Example::

        check_finite(float("nan"), "optim.weight_decay")
        # ConfigError: optim.weight_decay: must be a finite number, got nan
    """
    if isinstance(value, float):
        check(math.isfinite(value), key, f"must be a finite number, got {value}")
    elif isinstance(value, list | tuple):
        for item in value:
            check(
                not isinstance(item, float) or math.isfinite(item),
                key,
                f"must hold finite numbers, got {list(value)}",
            )
    elif isinstance(value, dict):
        for name, item in value.items():
            check_finite(item, f"{key}.{name}" if key else str(name))


def check_fields_finite(schema: Any, group: str) -> None:
    """:func:`check_finite` on every field of a config dataclass (nested ones have their own)."""
    for item in dataclasses.fields(schema):
        value = getattr(schema, item.name)
        if not dataclasses.is_dataclass(value):
            check_finite(value, f"{group}.{item.name}")


def check_fp32(value: float, key: str) -> None:
    """``value`` fits a float32, the type of the weights it is applied to."""
    check(
        abs(value) <= FP32_MAX,
        key,
        f"{value} overflows float32, the weights' type (at most {FP32_MAX:.3g})",
    )


def host_memory_bytes() -> int:
    """This machine's physical memory (RAM), the most any data held in memory can take."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_memory(nbytes: int, keys: str, what: str) -> None:
    """Refuse, before allocating, data that could never fit this machine's memory.

    A size typed with a few zeros too many would otherwise be rendered or drawn for minutes
    and then die out of memory; this says so at once, naming the keys that set it::

        check_fits_memory(10**12 * 64, "data.train_size, data.features", "the training set")
        # ConfigError: data.train_size, data.features: the training set would take 58 TiB of
        # memory; this machine has 24 GiB
    """
    ram = host_memory_bytes()
    check(
        nbytes <= ram,
        keys,
        f"{what} would take {_human_bytes(nbytes)} of memory; this machine has {_human_bytes(ram)}",
    )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_optional_path(value: Any, key: str) -> None:
    """``value`` is a path (a string) or None."""
    check(value is None or isinstance(value, str), key, f"must be a path or null, got {value!r}")


# --------------------------------------------------------------------------- pipeline

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


# --------------------------------------------------------------------------- optimizer


@dataclass
class LRScheduleConfig:
    """Learning-rate schedule: linear warm-up, then a decay rule (multiplies ``optim.lr``)."""

    name: str = "constant"
    """``constant``, ``cosine``, ``exponential`` or ``inverse_sqrt``."""
    warmup_steps: int = 0
    """Linear warm-up length in optimizer steps (or use warmup_epochs)."""
    warmup_epochs: float = 0.0
    """Linear warm-up length in epochs; converted with the data's steps per epoch."""
    decay_rate: float = 0.97
    """exponential: multiply the lr by this every decay period."""
    decay_steps: int = 0
    """exponential: decay period in steps (or use decay_epochs)."""
    decay_epochs: float = 0.0
    """exponential: decay period in epochs, e.g. 2.4 for the AmoebaNet recipe."""
    staircase: bool = False
    """exponential: decay in discrete jumps rather than continuously."""
    min_ratio: float = 0.0
    """cosine: final lr as a fraction of optim.lr."""

    def __post_init__(self) -> None:
        check_fields_finite(self, "optim.lr_schedule")
        check_choice(self.name, LR_SCHEDULES, "optim.lr_schedule.name")
        check_min(self.warmup_steps, 0, "optim.lr_schedule.warmup_steps")
        check_min(self.warmup_epochs, 0.0, "optim.lr_schedule.warmup_epochs")
        check(
            not (self.warmup_steps and self.warmup_epochs),
            "optim.lr_schedule.warmup_epochs",
            "set warmup_steps or warmup_epochs, not both",
        )
        check(
            0.0 < self.decay_rate <= 1.0,
            "optim.lr_schedule.decay_rate",
            f"must be in (0, 1], got {self.decay_rate}",
        )
        check_min(self.decay_steps, 0, "optim.lr_schedule.decay_steps")
        check_min(self.decay_epochs, 0.0, "optim.lr_schedule.decay_epochs")
        if self.name == "exponential":
            check(
                bool(self.decay_steps) != bool(self.decay_epochs),
                "optim.lr_schedule.decay_steps",
                "exponential decay needs exactly one of decay_steps or decay_epochs",
            )
        check(
            0.0 <= self.min_ratio <= 1.0,
            "optim.lr_schedule.min_ratio",
            f"must be in [0, 1], got {self.min_ratio}",
        )


@dataclass
class OptimConfig:
    """Optimizer and its learning-rate schedule."""

    name: str = "adamw"
    """``sgd``, ``adam``, ``adamw`` or ``rmsprop``."""
    lr: float = 1e-3
    """Peak learning rate (after warm-up)."""
    weight_decay: float = 0.0
    """L2 penalty (decoupled for adamw)."""
    momentum: float = 0.0
    """sgd / rmsprop momentum."""
    nesterov: bool = False
    """sgd: Nesterov momentum (needs momentum > 0)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """adam / adamw coefficients."""
    eps: float = 1e-8
    """Denominator epsilon (TF-style rmsprop uses 1.0)."""
    alpha: float = 0.99
    """rmsprop: decay of the squared-gradient average (TF calls it ``decay``; TF uses 0.9)."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Learning-rate schedule (``pipeline.schedule`` is the pipeline's order of actions)."""

    def __post_init__(self) -> None:
        check_fields_finite(self, "optim")
        check_choice(self.name, OPTIMIZERS, "optim.name")
        check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        for key in ("lr", "weight_decay", "momentum", "eps"):
            check_fp32(getattr(self, key), f"optim.{key}")
        check_min(self.weight_decay, 0.0, "optim.weight_decay")
        check_min(self.momentum, 0.0, "optim.momentum")
        check(
            not self.nesterov or self.momentum > 0,
            "optim.nesterov",
            "Nesterov momentum needs optim.momentum > 0",
        )
        check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "optim.betas",
            f"must be two numbers in [0, 1), got {list(self.betas)}",
        )
        check(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        check(0.0 < self.alpha < 1.0, "optim.alpha", f"must be in (0, 1), got {self.alpha}")


# --------------------------------------------------------------------------- trainer


@dataclass
class TrainerConfig:
    """Length of training, evaluation, checkpoints, regularization and resumption."""

    max_steps: int | None = 100
    """Optimizer steps to train for (or set max_epochs and make this null)."""
    max_epochs: float | None = None
    """Epochs to train for; converted with the data's steps per epoch."""
    accumulate: int = 1
    """Engine steps (batches) per optimizer step; grads equal those of the combined batch."""
    eval_every: int = 50
    """Evaluate every N optimizer steps (0: only at the end)."""
    eval_batches: int | None = None
    """Evaluate on the first N eval batches (null: all)."""
    log_every: int = 10
    """Write a metrics line every N optimizer steps."""
    checkpoint_every: int = 0
    """Also keep ``step_N.pt`` every N steps (0: only ``last.pt``)."""
    save_last: bool = True
    """Write ``last.pt`` at every evaluation and at the end."""
    async_save: bool = False
    """Write checkpoints in a background thread: the step waits only for the copy of the state
    to host memory; the next save, and the end of the run, wait for the write (whose failure
    is reported there)."""
    resume: Any = False
    """false; true (``last/`` in the run directory); ``auto`` (resume where the run directory
    holds a checkpoint, start where it holds none, skip a run that completed: one command
    restarts a killed sweep); or a path to a checkpoint (a directory, or a ``.pt`` file of the
    earlier format)."""
    resume_changed: list[str] = field(default_factory=list)
    """What a resume may change on purpose among the keys it checks against the saved run's
    config (``trainer.seed`` and every ``model.*`` and ``data.*`` key), e.g. ``[trainer.seed]``,
    ``[data.root]`` or a whole group, ``[data]``. Anything else (steps, evaluation, the LR
    schedule's length, the pipeline's shape) may change freely."""
    seed: int = 0
    """Seeds python, numpy (if present) and torch, and the order of training batches."""
    grad_clip: float | None = None
    """Clip gradients to this global norm across all stages (null: no clipping)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights with this decay; evaluate with it."""
    init_from: str | None = None
    """Fine-tune: start from this checkpoint's weights (its EMA when it kept one), loading every
    tensor whose name and shape match; the rest (a classifier for another number of classes)
    keep their fresh initialization. Optimizer, step and data position start anew. Ignored when
    resuming (trainer.resume), which restores the run's own checkpoint."""
    predict: bool = True
    """After the first step, profile the stages once and log the simulator's predicted step
    time, bubble and peak memory beside the measured ones (summary: pipeline/predicted_*).
    Under torchrun: after the second step, from every rank's timings of it."""
    trace_steps: list[int] = field(default_factory=list)
    """Optimizer steps to write as Chrome / Perfetto traces, ``trace-stepN.json`` in the run
    directory (e.g. ``[5]``): one track per stage (per rank under torchrun) with forward,
    backward, recompute, wait, send and receive, beside the simulated step once
    trainer.predict has made it (docs/profiling.md)."""
    save_signal: str | None = None
    """A signal that saves a checkpoint at the next step boundary and goes on, e.g. ``SIGUSR1``
    (SLURM: ``--signal=USR1@120``). SIGTERM always saves and stops (exit 143), SIGHUP (a dropped
    terminal) too (exit 129) unless it is the save signal, Ctrl-C stops (exit 130)."""
    overwrite: bool = False
    """A fresh run into a directory holding another run's record (metrics, summary) but no
    checkpoint: true moves that record aside (``replaced-N/``) and starts over; false refuses."""

    def __post_init__(self) -> None:
        check_fields_finite(self, "trainer")
        check_optional_path(self.init_from, "trainer.init_from")
        check(
            (self.max_steps is None) != (self.max_epochs is None),
            "trainer.max_steps",
            "set exactly one of trainer.max_steps or trainer.max_epochs (make the other null)",
        )
        if self.max_steps is not None:
            check_min(self.max_steps, 1, "trainer.max_steps")
        if self.max_epochs is not None:
            check(self.max_epochs > 0, "trainer.max_epochs", f"must be > 0, got {self.max_epochs}")
        check_min(self.accumulate, 1, "trainer.accumulate")
        check_min(self.eval_every, 0, "trainer.eval_every")
        if self.eval_batches is not None:
            check_min(self.eval_batches, 1, "trainer.eval_batches")
        check_min(self.log_every, 1, "trainer.log_every")
        check_min(self.checkpoint_every, 0, "trainer.checkpoint_every")
        check(
            isinstance(self.trace_steps, list | tuple)
            and all(isinstance(n, int) and n >= 1 for n in self.trace_steps),
            "trainer.trace_steps",
            f"must be a list of optimizer steps (>= 1), e.g. [5]; got {self.trace_steps!r}",
        )
        check(
            isinstance(self.resume, bool | str) and self.resume != "",
            "trainer.resume",
            f"must be true, false, auto or a checkpoint path; got {self.resume!r}",
        )
        self._check_resume_changed()
        if self.grad_clip is not None:
            check(self.grad_clip > 0, "trainer.grad_clip", f"must be > 0, got {self.grad_clip}")
        check(
            0.0 <= self.label_smoothing < 1.0,
            "trainer.label_smoothing",
            f"must be in [0, 1), got {self.label_smoothing}",
        )
        if self.ema_decay is not None:
            check(
                0.0 < self.ema_decay < 1.0,
                "trainer.ema_decay",
                f"must be in (0, 1), got {self.ema_decay}",
            )
        check(
            isinstance(self.seed, int) and 0 <= self.seed < 2**64,
            "trainer.seed",
            f"must be an integer in [0, 2**64), got {self.seed}",
        )
        if self.save_signal is not None:
            check_choice(self.save_signal, SAVE_SIGNALS, "trainer.save_signal")

    def _check_resume_changed(self) -> None:
        entries = self.resume_changed
        check(
            isinstance(entries, list | tuple) and all(isinstance(e, str) for e in entries),
            "trainer.resume_changed",
            f"must be a list of keys, e.g. [trainer.seed]; got {entries!r}",
        )
        for entry in entries:
            checked = any(entry == k or entry.startswith(k + ".") for k in RESUME_CHECKED)
            check(
                checked,
                "trainer.resume_changed",
                f"{entry} is not checked on resume (only trainer.seed, model.* and data.* are); "
                "other keys may change without it",
            )


# --------------------------------------------------------------------------- logger, sweep


@dataclass
class LoggerConfig:
    """Where metrics go: progress bar, ``metrics.jsonl``, optionally Weights & Biases and
    TensorBoard."""

    progress: str = "auto"
    """``auto`` (a tqdm bar when stdout is a terminal), ``tqdm`` (always) or ``none``."""
    jsonl: bool = True
    """Append one JSON line per logging step to ``metrics.jsonl`` in the run directory."""
    wandb: bool = False
    """Also log to Weights & Biases (``logger=wandb``)."""
    wandb_project: str = "giantpipe"
    """W&B project name."""
    wandb_mode: str = "offline"
    """``offline`` (no network; sync later with ``wandb sync``), ``online`` or ``disabled``."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to ``RUN_DIR/tensorboard`` (needs ``tensorboard``)."""

    def __post_init__(self) -> None:
        check_choice(self.progress, PROGRESS_STYLES, "logger.progress")
        check_choice(self.wandb_mode, WANDB_MODES, "logger.wandb_mode")


@dataclass
class SweepConfig:
    """What a job returns to Hydra's sweeper (Optuna and friends optimize this)."""

    objective: str = "eval/loss"
    """A key of summary.json, e.g. ``eval/loss``, ``eval/accuracy``, ``train/samples_per_s``."""
    direction: str = "minimize"
    """``minimize`` or ``maximize`` (documentation for sweepers; failed jobs return NaN)."""

    def __post_init__(self) -> None:
        check(bool(self.objective), "sweep.objective", "must name a summary key")
        check_choice(self.direction, DIRECTIONS, "sweep.direction")


# --------------------------------------------------------------------------- experiment


@dataclass
class ExperimentConfig:
    """The whole experiment: one field per config group (recipes write across all of them)."""

    name: str = "run"
    """Experiment name (recipes set it); shown in the summary and in W&B."""
    model: Any = None
    """A ``_target_`` spec building a flat nn.Sequential: the option's schema (e.g.
    ``models.options.MlpModelConfig``) or a plain mapping."""
    data: Any = None
    """A ``_target_`` spec returning a giantpipe.data.bundle.DataBundle (e.g.
    ``giantpipe.data.tensors.SyntheticDataConfig``) or a plain mapping."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def __post_init__(self) -> None:
        for key in ("model", "data"):
            spec = getattr(self, key)
            target = (
                spec.get("_target_") if isinstance(spec, dict) else getattr(spec, "_target_", None)
            )
            check(bool(target), f"{key}._target_", f"missing: choose a {key}=OPTION")


SCHEMAS: dict[str, type] = {
    "pipeline": PipelineConfig,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "sweep": SweepConfig,
}
"""Fixed-schema groups, typed through ExperimentConfig's fields."""
