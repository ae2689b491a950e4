"""Experiment configuration: one dataclass schema per config group, validated in ``__post_init__``.

The Hydra tree under ``conf/`` is typed by these schemas (registered with Hydra's ConfigStore by
:func:`register_configs`) and converted to them once, at the entry point (``giantpipe.cli``).
Everything below the entry point receives plain dataclasses and never imports OmegaConf.

Every check raises :class:`ConfigError`, whose message starts with the dotted key, so a user sees
``pipeline.chunks: must be >= 1, got 0`` rather than a stack trace.

Example::

    from giantpipe.config import PipelineConfig, ConfigError

    PipelineConfig(chunks=8, balance=[2, 3])          # fine
    try:
        PipelineConfig(chunks=0)
    except ConfigError as err:
        print(err)                                    # pipeline.chunks: must be >= 1, got 0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHECKPOINT_MODES = ("always", "except_last", "never")
BALANCE_POLICIES = ("time", "memory", "params")
PRECISIONS = ("fp32", "bf16")
DEVICE_KEYWORDS = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
LR_SCHEDULES = ("constant", "cosine", "exponential", "inverse_sqrt")
PROGRESS_STYLES = ("auto", "tqdm", "none")
WANDB_MODES = ("offline", "online", "disabled")
DIRECTIONS = ("minimize", "maximize")


class ConfigError(ValueError):
    """A configuration value is invalid; ``key`` is the dotted key that names it.

    Example::

        raise ConfigError("trainer.max_steps", "must be >= 1, got 0")
    """

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def _check(ok: bool, key: str, problem: str) -> None:
    """Raise ``ConfigError(key, problem)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, problem)


def _check_choice(value: object, choices: tuple[str, ...], key: str) -> None:
    _check(value in choices, key, f"must be one of {', '.join(choices)}; got {value!r}")


def _check_min(value: float, low: float, key: str) -> None:
    _check(value >= low, key, f"must be >= {low}, got {value}")


def _check_optional_path(value: Any, key: str) -> None:
    _check(value is None or isinstance(value, str), key, f"must be a path or null, got {value!r}")


# --------------------------------------------------------------------------- pipeline


@dataclass
class PipelineConfig:
    """How the model is cut into stages and scheduled (the engine's GPipe arguments)."""

    devices: Any = "auto"
    """``auto`` (all visible GPUs, else CPU stand-ins), ``cpu``, ``cuda`` or a list of names."""
    num_devices: int | None = None
    """How many devices: CPU stand-ins to create, or the first N GPUs / listed devices.
    Null: all GPUs / listed devices; CPU stand-ins: one per stage of a listed balance, else 2."""
    balance: Any = "params"
    """Layers per stage (a list summing to the model's length) or ``time``/``memory``/``params``."""
    chunks: int = 4
    """M, micro-batches per mini-batch."""
    checkpoint: str = "except_last"
    """Re-materialization: ``always``, ``except_last`` or ``never``."""
    deferred_batch_norm: bool = False
    """Accumulate BatchNorm running statistics once per mini-batch instead of per micro-batch."""
    precision: str = "fp32"
    """``fp32`` or ``bf16`` (autocast around each engine step and evaluation)."""
    schedule: str = "gpipe"
    """Schedule name handed to the engine's ``train_step``."""

    def __post_init__(self) -> None:
        _check_min(self.chunks, 1, "pipeline.chunks")
        _check_choice(self.checkpoint, CHECKPOINT_MODES, "pipeline.checkpoint")
        _check_choice(self.precision, PRECISIONS, "pipeline.precision")
        _check(bool(self.schedule), "pipeline.schedule", "must be a non-empty schedule name")
        if self.num_devices is not None:
            _check_min(self.num_devices, 1, "pipeline.num_devices")
        self._check_devices()
        self._check_balance()

    def _check_devices(self) -> None:
        if isinstance(self.devices, str):
            _check_choice(self.devices, DEVICE_KEYWORDS, "pipeline.devices")
            return
        ok = isinstance(self.devices, list | tuple) and len(self.devices) > 0
        _check(ok, "pipeline.devices", f"must be auto, cpu, cuda or a list; got {self.devices!r}")
        _check(
            self.num_devices is None or self.num_devices <= len(self.devices),
            "pipeline.num_devices",
            f"{self.num_devices} exceeds the {len(self.devices)} devices in pipeline.devices",
        )

    def _check_balance(self) -> None:
        if isinstance(self.balance, str):
            _check_choice(self.balance, BALANCE_POLICIES, "pipeline.balance")
            return
        ok = isinstance(self.balance, list | tuple) and len(self.balance) > 0
        _check(ok, "pipeline.balance", f"must be a list or a policy; got {self.balance!r}")
        for count in self.balance:
            _check(
                isinstance(count, int) and count >= 1,
                "pipeline.balance",
                f"every stage needs >= 1 layer, got {list(self.balance)}",
            )


# --------------------------------------------------------------------------- optimizer


@dataclass
class ScheduleConfig:
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
        _check_choice(self.name, LR_SCHEDULES, "optim.schedule.name")
        _check_min(self.warmup_steps, 0, "optim.schedule.warmup_steps")
        _check_min(self.warmup_epochs, 0.0, "optim.schedule.warmup_epochs")
        _check(
            not (self.warmup_steps and self.warmup_epochs),
            "optim.schedule.warmup_epochs",
            "set warmup_steps or warmup_epochs, not both",
        )
        _check(
            0.0 < self.decay_rate <= 1.0,
            "optim.schedule.decay_rate",
            f"must be in (0, 1], got {self.decay_rate}",
        )
        _check_min(self.decay_steps, 0, "optim.schedule.decay_steps")
        _check_min(self.decay_epochs, 0.0, "optim.schedule.decay_epochs")
        if self.name == "exponential":
            _check(
                bool(self.decay_steps) != bool(self.decay_epochs),
                "optim.schedule.decay_steps",
                "exponential decay needs exactly one of decay_steps or decay_epochs",
            )
        _check(
            0.0 <= self.min_ratio <= 1.0,
            "optim.schedule.min_ratio",
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
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""

    def __post_init__(self) -> None:
        _check_choice(self.name, OPTIMIZERS, "optim.name")
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check_min(self.weight_decay, 0.0, "optim.weight_decay")
        _check_min(self.momentum, 0.0, "optim.momentum")
        _check(
            not self.nesterov or self.momentum > 0,
            "optim.nesterov",
            "Nesterov momentum needs optim.momentum > 0",
        )
        _check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "optim.betas",
            f"must be two numbers in [0, 1), got {list(self.betas)}",
        )
        _check(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        _check(0.0 < self.alpha < 1.0, "optim.alpha", f"must be in (0, 1), got {self.alpha}")


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
    resume: Any = False
    """false; true (``last.pt`` in the run directory); or a path to a checkpoint file."""
    seed: int = 0
    """Seeds python, numpy (if present) and torch, and the order of training batches."""
    grad_clip: float | None = None
    """Clip gradients to this global norm across all stages (null: no clipping)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights with this decay; evaluate with it."""

    def __post_init__(self) -> None:
        _check(
            (self.max_steps is None) != (self.max_epochs is None),
            "trainer.max_steps",
            "set exactly one of trainer.max_steps or trainer.max_epochs (make the other null)",
        )
        if self.max_steps is not None:
            _check_min(self.max_steps, 1, "trainer.max_steps")
        if self.max_epochs is not None:
            _check(self.max_epochs > 0, "trainer.max_epochs", f"must be > 0, got {self.max_epochs}")
        _check_min(self.accumulate, 1, "trainer.accumulate")
        _check_min(self.eval_every, 0, "trainer.eval_every")
        if self.eval_batches is not None:
            _check_min(self.eval_batches, 1, "trainer.eval_batches")
        _check_min(self.log_every, 1, "trainer.log_every")
        _check_min(self.checkpoint_every, 0, "trainer.checkpoint_every")
        _check(
            isinstance(self.resume, bool | str) and self.resume != "",
            "trainer.resume",
            f"must be true, false or a checkpoint path; got {self.resume!r}",
        )
        if self.grad_clip is not None:
            _check(self.grad_clip > 0, "trainer.grad_clip", f"must be > 0, got {self.grad_clip}")
        _check(
            0.0 <= self.label_smoothing < 1.0,
            "trainer.label_smoothing",
            f"must be in [0, 1), got {self.label_smoothing}",
        )
        if self.ema_decay is not None:
            _check(
                0.0 < self.ema_decay < 1.0,
                "trainer.ema_decay",
                f"must be in (0, 1), got {self.ema_decay}",
            )


# --------------------------------------------------------------------------- logger, sweep


@dataclass
class LoggerConfig:
    """Where metrics go: progress bar, ``metrics.jsonl``, optionally Weights & Biases."""

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

    def __post_init__(self) -> None:
        _check_choice(self.progress, PROGRESS_STYLES, "logger.progress")
        _check_choice(self.wandb_mode, WANDB_MODES, "logger.wandb_mode")


@dataclass
class SweepConfig:
    """What a job returns to Hydra's sweeper (Optuna and friends optimize this)."""

    objective: str = "eval/loss"
    """A key of summary.json, e.g. ``eval/loss``, ``eval/accuracy``, ``train/samples_per_s``."""
    direction: str = "minimize"
    """``minimize`` or ``maximize`` (documentation for sweepers; failed jobs return NaN)."""

    def __post_init__(self) -> None:
        _check(bool(self.objective), "sweep.objective", "must name a summary key")
        _check_choice(self.direction, DIRECTIONS, "sweep.direction")


# --------------------------------------------------------------------------- model, data


@dataclass
class MlpModelConfig:
    """``models.mlp.mlp``: a small residual-free MLP classifier for quick starts and tests."""

    _target_: str = "models.mlp.mlp"
    """Builder called with the other fields."""
    in_features: int = 16
    """Input width."""
    hidden: int = 64
    """Hidden width."""
    depth: int = 4
    """Hidden blocks; the Sequential has depth + 1 children (blocks and the head)."""
    classes: int = 8
    """Output classes."""
    dropout: float = 0.0
    """Dropout after each block."""
    norm: str = "layer"
    """``layer``, ``batch`` or ``none``."""

    def __post_init__(self) -> None:
        for key in ("in_features", "hidden", "depth", "classes"):
            _check_min(getattr(self, key), 1, f"model.{key}")
        _check(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        _check_choice(self.norm, ("layer", "batch", "none"), "model.norm")


@dataclass
class SyntheticDataConfig:
    """``giantpipe.data.synthetic.classification``: generated, learnable classification data."""

    _target_: str = "giantpipe.data.synthetic.classification"
    """Builder called with the other fields."""
    features: int = 16
    """Input width."""
    classes: int = 8
    """Number of classes."""
    train_size: int = 16384
    """Training samples."""
    eval_size: int = 512
    """Evaluation samples."""
    batch_size: int = 64
    """Mini-batch size N (the engine splits it into pipeline.chunks micro-batches)."""
    noise: float = 0.1
    """Standard deviation of the noise added to the teacher's logits (higher: harder)."""
    seed: int = 1234
    """Seed of the generated data set (the batch order follows trainer.seed)."""

    def __post_init__(self) -> None:
        for key in ("features", "classes", "train_size", "eval_size", "batch_size"):
            _check_min(getattr(self, key), 1, f"data.{key}")
        _check(self.classes >= 2, "data.classes", f"must be >= 2, got {self.classes}")
        _check(
            self.batch_size <= self.train_size,
            "data.batch_size",
            f"must be <= data.train_size ({self.train_size}), got {self.batch_size}",
        )
        _check_min(self.noise, 0.0, "data.noise")


@dataclass
class TensorDataConfig:
    """``giantpipe.data.tensors.tensor_files``: (inputs, targets) in train.pt and eval.pt."""

    _target_: str = "giantpipe.data.tensors.tensor_files"
    """Builder called with the other fields."""
    root: str = "???"
    """Directory holding train.pt and eval.pt, each a tuple (inputs, targets)."""
    features: int = "???"  # type: ignore[assignment]
    """Width of an input (last dimension); checked against the files; the model reads it."""
    classes: int = "???"  # type: ignore[assignment]
    """Output width: classes for cross_entropy, target width for mse; the model reads it."""
    batch_size: int = 64
    """Mini-batch size N."""
    loss: str = "cross_entropy"
    """``cross_entropy`` (integer targets) or ``mse``."""

    def __post_init__(self) -> None:
        for key in ("features", "classes", "batch_size"):
            _check_min(getattr(self, key), 1, f"data.{key}")
        _check_choice(self.loss, ("cross_entropy", "mse"), "data.loss")


# --------------------------------------------------------------------------- experiment


@dataclass
class ExperimentConfig:
    """The whole experiment: one field per config group (recipes write across all of them)."""

    name: str = "run"
    """Experiment name (recipes set it); shown in the summary and in W&B."""
    model: Any = None
    """A ``_target_`` spec: a model schema (e.g. MlpModelConfig) or a plain mapping."""
    data: Any = None
    """A ``_target_`` spec returning a giantpipe.data.bundle.DataBundle."""
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
            _check(bool(target), f"{key}._target_", f"missing: choose a {key}=OPTION")


SCHEMAS: dict[str, type] = {
    "pipeline": PipelineConfig,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "sweep": SweepConfig,
}
"""Fixed-schema groups, typed through ExperimentConfig's fields."""

OPTION_SCHEMAS: dict[tuple[str, str], type] = {
    ("model", "base_mlp"): MlpModelConfig,
    ("data", "base_synthetic"): SyntheticDataConfig,
    ("data", "base_tensors"): TensorDataConfig,
}
"""Schemas of ``_target_`` groups, one per option; an option's yaml lists its schema first."""


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (call before ``@hydra.main`` composes).

    Example::

        register_configs()   # then conf/config.yaml's defaults can name base_config

    Hydra is imported here, not at module level, so the runner can import the schemas without it.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="base_config", node=ExperimentConfig)
    for (group, name), schema in OPTION_SCHEMAS.items():
        store.store(group=group, name=name, node=schema)
