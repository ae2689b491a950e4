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

RECOMPUTE_MODES = ("always", "except_last", "never")
BALANCE_POLICIES = ("time", "memory", "params")
PRECISIONS = ("fp32", "bf16")
DEVICE_KEYWORDS = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
LR_SCHEDULES = ("constant", "cosine", "exponential", "inverse_sqrt")
PROGRESS_STYLES = ("auto", "tqdm", "none")
WANDB_MODES = ("offline", "online", "disabled")
DIRECTIONS = ("minimize", "maximize")
PLAN_MODES = ("auto",)

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

EXECUTORS = ("local", "distributed")


@dataclass
class PipelineConfig:
    """How the model is cut into stages and scheduled (the engine's GPipe arguments)."""

    executor: str = "local"
    """``local``: one process, a worker thread per stage. ``distributed``: one process per
    stage under torchrun (``torchrun --nproc_per_node=K train.py pipeline.executor=distributed``;
    K pipeline ranks x R replicas = the world size, see giantpipe.runner.distributed)."""
    timeout: float = 60.0
    """Distributed: seconds any wait for another rank may take before the run fails."""
    devices: Any = "auto"
    """``auto`` (all visible GPUs, else CPU stand-ins), ``cpu``, ``cuda`` or a list of names."""
    num_devices: int | None = None
    """How many devices: CPU stand-ins to create, or the first N GPUs / listed devices.
    Null: all GPUs / listed devices; CPU stand-ins: one per stage of a listed balance, else 2."""
    balance: Any = "params"
    """Layers per stage (a list summing to the model's length) or ``time``/``memory``/``params``."""
    chunks: int = 4
    """M, micro-batches per mini-batch."""
    recompute: str = "except_last"
    """Re-materialization mode: ``always``, ``except_last`` or ``never``; passed to the engine's
    torchgpipe-compatible ``checkpoint=`` argument (saving runs: ``trainer.checkpoint_every``)."""
    deferred_batch_norm: bool = False
    """Accumulate BatchNorm running statistics once per mini-batch instead of per micro-batch."""
    precision: str = "fp32"
    """``fp32`` or ``bf16`` (autocast around each engine step and evaluation)."""
    schedule: str = "gpipe"
    """Schedule name handed to the engine's ``train_step``."""
    virtual_stages: int = 1
    """V, model chunks per device (``interleaved``): a listed balance then has K*V entries."""
    plan: str | None = None
    """Null: use balance, chunks, recompute, schedule and virtual_stages as set. ``auto``: the
    planner (giantpipe.plan) picks those five by simulating every candidate on layer times
    measured on these devices, within memory_budget_gib; the other keys stay as set."""
    memory_budget_gib: float | None = None
    """plan=auto: memory per device in GiB (weights, gradients, optimizer state, activations).
    Null: a GPU's total memory; CPU stand-ins: the machine's RAM shared evenly."""

    def __post_init__(self) -> None:
        _check_min(self.chunks, 1, "pipeline.chunks")
        _check_min(self.virtual_stages, 1, "pipeline.virtual_stages")
        _check(
            self.plan is None or self.plan in PLAN_MODES,
            "pipeline.plan",
            f"must be null or auto, got {self.plan!r}",
        )
        _check(
            self.plan is None or self.executor == "local",
            "pipeline.plan",
            "auto plans the local executor only; with pipeline.executor=distributed set "
            "balance, chunks, recompute and schedule by hand",
        )
        if self.memory_budget_gib is not None:
            _check(
                self.memory_budget_gib > 0,
                "pipeline.memory_budget_gib",
                f"must be > 0 (GiB per device) or null, got {self.memory_budget_gib}",
            )
        _check_choice(self.recompute, RECOMPUTE_MODES, "pipeline.recompute")
        _check_choice(self.precision, PRECISIONS, "pipeline.precision")
        _check(bool(self.schedule), "pipeline.schedule", "must be a non-empty schedule name")
        if self.num_devices is not None:
            _check_min(self.num_devices, 1, "pipeline.num_devices")
        self._check_devices()
        self._check_balance()
        self._check_executor()

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

    def _check_executor(self) -> None:
        _check_choice(self.executor, EXECUTORS, "pipeline.executor")
        _check(self.timeout > 0, "pipeline.timeout", f"must be > 0 seconds, got {self.timeout}")


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
        _check_choice(self.name, LR_SCHEDULES, "optim.lr_schedule.name")
        _check_min(self.warmup_steps, 0, "optim.lr_schedule.warmup_steps")
        _check_min(self.warmup_epochs, 0.0, "optim.lr_schedule.warmup_epochs")
        _check(
            not (self.warmup_steps and self.warmup_epochs),
            "optim.lr_schedule.warmup_epochs",
            "set warmup_steps or warmup_epochs, not both",
        )
        _check(
            0.0 < self.decay_rate <= 1.0,
            "optim.lr_schedule.decay_rate",
            f"must be in (0, 1], got {self.decay_rate}",
        )
        _check_min(self.decay_steps, 0, "optim.lr_schedule.decay_steps")
        _check_min(self.decay_epochs, 0.0, "optim.lr_schedule.decay_epochs")
        if self.name == "exponential":
            _check(
                bool(self.decay_steps) != bool(self.decay_epochs),
                "optim.lr_schedule.decay_steps",
                "exponential decay needs exactly one of decay_steps or decay_epochs",
            )
        _check(
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
    init_from: str | None = None
    """Fine-tune: start from this checkpoint's weights (its EMA when it kept one), loading every
    tensor whose name and shape match; the rest (a classifier for another number of classes)
    keep their fresh initialization. Optimizer, step and data position start anew. Ignored when
    resuming (trainer.resume), which restores the run's own checkpoint."""
    predict: bool = True
    """After the first step, profile the stages once and log the simulator's predicted step
    time, bubble and peak memory beside the measured ones (summary: pipeline/predicted_*).
    Local executor only (pipeline.executor=distributed runs no forecast)."""

    def __post_init__(self) -> None:
        _check_optional_path(self.init_from, "trainer.init_from")
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
    """``giantpipe.data.tensors.classification``: generated, learnable classification data."""

    _target_: str = "giantpipe.data.tensors.classification"
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


# ------------------------------------------------------------------- transformer, translation

FFN_INIT_SCALES = ("sqrt", "linear")
LOGIT_CLIP_MODES = ("tanh", "clamp")


def _check_stabilizers(ffn_init_scale: Any, logit_clip: float | None, mode: str) -> None:
    """The paper's two stabilizers of deep Transformers (models.transformer_layers)."""
    ok = ffn_init_scale is None or ffn_init_scale in FFN_INIT_SCALES
    ok = ok or (isinstance(ffn_init_scale, int | float) and ffn_init_scale > 0)
    _check(ok, "model.ffn_init_scale", f"must be null, sqrt, linear or > 0; got {ffn_init_scale!r}")
    if logit_clip is not None:
        _check(logit_clip > 0, "model.logit_clip", f"must be > 0 or null, got {logit_clip}")
    _check_choice(mode, LOGIT_CLIP_MODES, "model.logit_clip_mode")


def _check_dropouts(dropout: float, attn_dropout: float) -> None:
    for key, value in (("model.dropout", dropout), ("model.attn_dropout", attn_dropout)):
        _check(0.0 <= value < 1.0, key, f"must be in [0, 1), got {value}")


@dataclass
class TransformerTModelConfig:
    """``models.transformer.transformer_t``: the paper's T(L, H, A) encoder-decoder."""

    _target_: str = "models.transformer.transformer_t"
    """Builder called with the other fields."""
    num_layers: int = 6
    """L: encoder layers, and as many decoder layers (the Sequential has 2L + 2 children)."""
    ffn_dim: int = 8192
    """H: feed-forward width."""
    num_heads: int = 16
    """A: attention heads (attention width A * head_dim)."""
    d_model: int = 1024
    """Model dimension (1024 in the paper's multilingual models)."""
    head_dim: int = 64
    """Width of one attention head."""
    vocab_size: int = 64000
    """Output classes; the data's shared SentencePiece vocabulary must fit (data.vocab_size)."""
    max_len: int = 256
    """Longest sequence (size of the position table)."""
    dropout: float = 0.1
    """Dropout on embeddings, residual branches and inside the feed-forward blocks."""
    attn_dropout: float = 0.0
    """Dropout on attention weights."""
    share_embeddings: bool = True
    """One token table for source and target."""
    tie_embeddings: bool = False
    """Reuse the token table as the softmax weight: one parameter in the first and the last
    child, which the engine does not support, so the runner rejects it (plain-model use only)."""
    ffn_init_scale: Any = None
    """Stabilizer 1: multiply feed-forward init by 1/L (``linear``), 1/sqrt(2L) (``sqrt``), a
    number, or null (off)."""
    logit_clip: float | None = None
    """Stabilizer 2: bound |logits| by this threshold (null: off)."""
    logit_clip_mode: str = "tanh"
    """``clamp`` (hard clip) or ``tanh`` (soft cap c * tanh(x / c))."""
    pad_id: int = 0
    """Padding token id (the data's SentencePiece uses 0)."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "ffn_dim", "num_heads", "d_model", "head_dim", "vocab_size"):
            _check_min(getattr(self, key), 1, f"model.{key}")
        _check_min(self.max_len, 2, "model.max_len")
        _check_dropouts(self.dropout, self.attn_dropout)
        _check(
            self.share_embeddings or not self.tie_embeddings,
            "model.tie_embeddings",
            "needs model.share_embeddings=true",
        )
        _check_stabilizers(self.ffn_init_scale, self.logit_clip, self.logit_clip_mode)


@dataclass
class TransformerLMModelConfig:
    """``models.transformer_lm.transformer_lm``: the decoder-only Transformer-L of Table 1."""

    _target_: str = "models.transformer_lm.transformer_lm"
    """Builder called with the other fields."""
    num_layers: int = 48
    """L: causal self-attention layers (Table 2 uses 48; Table 1 3 to 1663)."""
    d_model: int = 2048
    """Model dimension."""
    ffn_dim: int = 8192
    """Feed-forward width."""
    num_heads: int = 32
    """Attention heads; d_model must divide evenly."""
    vocab_size: int = 32000
    """Vocabulary (untied input embedding and softmax)."""
    max_len: int = 1024
    """Longest sequence (size of the position table)."""
    dropout: float = 0.0
    """Dropout on embeddings and residual branches."""
    attn_dropout: float = 0.0
    """Dropout on attention weights."""
    ffn_init_scale: Any = None
    """Feed-forward init scaling (``linear``, ``sqrt``, a number or null)."""
    logit_clip: float | None = None
    """Bound |logits| by this threshold (null: off)."""
    logit_clip_mode: str = "tanh"
    """``clamp`` or ``tanh``."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "d_model", "ffn_dim", "num_heads", "vocab_size", "max_len"):
            _check_min(getattr(self, key), 1, f"model.{key}")
        _check(
            self.d_model % self.num_heads == 0,
            "model.num_heads",
            f"must divide model.d_model ({self.d_model}), got {self.num_heads}",
        )
        _check_dropouts(self.dropout, self.attn_dropout)
        _check_stabilizers(self.ffn_init_scale, self.logit_clip, self.logit_clip_mode)


@dataclass
class TranslationDataConfig:
    """``giantpipe.data.translation_bundle.translation``: multilingual parallel text."""

    _target_: str = "giantpipe.data.translation_bundle.translation"
    """Builder called with the other fields (and the run directory)."""
    train_files: list[str] | None = None
    """TSV (header row), JSONL or parquet files of (source, target, pair) rows; null: write the
    generated multilingual corpus into the run directory and train on it."""
    valid_files: list[str] | None = None
    """Held-out files for the eval loss and BLEU (needed with train_files)."""
    source_field: str = "source"
    """Column of the source sentence."""
    target_field: str = "target"
    """Column of the target sentence."""
    pair_field: str = "pair"
    """Column naming the language pair, e.g. ``en-de``."""
    vocab_size: int = 8000
    """Shared SentencePiece vocabulary size (an upper bound; the model's output size)."""
    vocab_dir: str | None = None
    """Where spm.model is trained or reused; null: the run directory (reused on resume)."""
    max_len: int = 128
    """Drop training pairs longer than this many tokens (with markers)."""
    max_tokens: int = 4096
    """Batch size in tokens: sentences x padded length <= max_tokens."""
    min_sentences: int = 1
    """Fewest sentences in a batch (the recipes set it to pipeline.chunks)."""
    temperature: float = 5.0
    """Sampling temperature over language pairs: p ~ (n_pair / N)^(1/T)."""
    generated_languages: int = 3
    """Generated corpus: languages besides English (pairs en-xx and xx-en)."""
    generated_train_sizes: list[int] | None = None
    """Generated corpus: training sentences per language (null: 8000, 2000, 500, ...)."""
    generated_eval_size: int = 100
    """Generated corpus: held-out sentences per direction."""
    generated_seed: int = 0
    """Generated corpus: seed of the languages and sentences."""
    bleu_sentences: int | None = 100
    """Held-out sentences per pair decoded for BLEU at each evaluation (null: all; 0: none)."""
    beam_size: int = 1
    """1: greedy decoding; more: beam search with a GNMT length penalty."""
    length_penalty: float = 0.6
    """Beam search length penalty alpha."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "max_len", "max_tokens", "min_sentences", "beam_size"):
            _check_min(getattr(self, key), 1, f"data.{key}")
        _check(self.temperature > 0, "data.temperature", f"must be > 0, got {self.temperature}")
        _check_min(self.generated_languages, 1, "data.generated_languages")
        _check_min(self.generated_eval_size, 1, "data.generated_eval_size")
        if self.bleu_sentences is not None:
            _check_min(self.bleu_sentences, 0, "data.bleu_sentences")
        _check(
            self.max_tokens >= self.min_sentences * 4,
            "data.max_tokens",
            f"{self.max_tokens} leaves no room for {self.min_sentences} sentences per batch",
        )


@dataclass
class LMTokensDataConfig:
    """``giantpipe.data.tensors.lm_tokens``: generated token sequences for Transformer-L."""

    _target_: str = "giantpipe.data.tensors.lm_tokens"
    """Builder called with the other fields."""
    vocab_size: int = 32000
    """Token ids are drawn below this."""
    seq_len: int = 1024
    """Tokens per sequence (the paper's Transformer-L uses 1024)."""
    batch_size: int = 32
    """Sequences per mini-batch N."""
    batches_per_epoch: int = 1000
    """Nominal epoch length (the stream is endless)."""
    eval_batches: int = 2
    """Held-out batches for the eval loss."""
    branching: int = 4
    """Each token has this many possible successors, so the loss can fall to ln(branching)."""
    seed: int = 1234
    """Seed of the successor table and the held-out batches."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "batches_per_epoch", "eval_batches", "branching"):
            _check_min(getattr(self, key), 1, f"data.{key}")
        _check_min(self.seq_len, 2, "data.seq_len")
        _check_min(self.batch_size, 1, "data.batch_size")
        _check(
            self.branching <= self.vocab_size,
            "data.branching",
            f"must be <= data.vocab_size ({self.vocab_size}), got {self.branching}",
        )


# --------------------------------------------------------------------------- amoebanet, images


@dataclass
class AmoebaNetModelConfig:
    """``models.amoebanet.amoebanet``: AmoebaNet-D or -B (L, D) as a flat Sequential of L + 6."""

    _target_: str = "models.amoebanet.amoebanet"
    """Builder called with the other fields."""
    genotype: str = "D"
    """``D`` (the paper's speed and size tables) or ``B`` (its ImageNet model)."""
    num_layers: int = 18
    """L, normal cells; a multiple of 3."""
    num_filters: int = 256
    """D, base filters; a multiple of 8."""
    num_classes: int = 1000
    """Classifier outputs (the option yaml takes it from data.num_classes)."""
    image_size: int = 224
    """Resolution the model is meant for (>= 32; the option yaml takes it from data.image_size)."""
    drop_path: float = 0.0
    """Probability of dropping a cell branch (TF AmoebaNet: keep 0.7, i.e. 0.3)."""
    bn_momentum: float | None = None
    """BatchNorm momentum in torch's sense (TF's decay 0.9997 is 0.0003); null: torch's 0.1."""
    bn_eps: float | None = None
    """BatchNorm epsilon (TF AmoebaNet: 1e-3); null: torch's 1e-5."""

    def __post_init__(self) -> None:
        _check_choice(str(self.genotype).upper(), ("D", "B"), "model.genotype")
        _check(
            self.num_layers >= 3 and self.num_layers % 3 == 0,
            "model.num_layers",
            f"must be a positive multiple of 3, got {self.num_layers}",
        )
        _check(
            self.num_filters >= 8 and self.num_filters % 8 == 0,
            "model.num_filters",
            f"must be a positive multiple of 8, got {self.num_filters}",
        )
        _check_min(self.num_classes, 1, "model.num_classes")
        _check_min(self.image_size, 32, "model.image_size")
        _check(
            0.0 <= self.drop_path < 1.0,
            "model.drop_path",
            f"must be in [0, 1), got {self.drop_path}",
        )
        if self.bn_momentum is not None:
            _check(
                0.0 <= self.bn_momentum <= 1.0,
                "model.bn_momentum",
                f"must be in [0, 1], got {self.bn_momentum}",
            )
        if self.bn_eps is not None:
            _check(self.bn_eps > 0, "model.bn_eps", f"must be > 0, got {self.bn_eps}")


def _check_image_batches(image_size: int, batch_size: int, num_classes: int) -> None:
    _check_min(image_size, 8, "data.image_size")
    _check_min(batch_size, 1, "data.batch_size")
    _check_min(num_classes, 2, "data.num_classes")


@dataclass
class GeneratedImagesDataConfig:
    """``giantpipe.data.image_bundle.generated_images``: learnable textured images, no files."""

    _target_: str = "giantpipe.data.image_bundle.generated_images"
    """Builder called with the other fields."""
    image_size: int = 32
    """Height and width in pixels."""
    num_classes: int = 10
    """Classes (each a pattern family, orientation and colour pair)."""
    train_size: int = 4096
    """Training images (rendered once at start-up, about 1 ms each at 32 px)."""
    eval_size: int = 512
    """Held-out images (rendered from seed + 1, so never training images)."""
    batch_size: int = 64
    """Mini-batch size N."""
    noise: float = 0.08
    """Pixel noise (higher: harder)."""
    seed: int = 0
    """Seed of the images (the batch order follows trainer.seed)."""

    def __post_init__(self) -> None:
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        _check(
            self.batch_size <= self.train_size,
            "data.batch_size",
            f"must be <= data.train_size ({self.train_size}), got {self.batch_size}",
        )
        _check_min(self.eval_size, 1, "data.eval_size")
        _check_min(self.noise, 0.0, "data.noise")


@dataclass
class RandomImagesDataConfig:
    """``giantpipe.data.image_bundle.random_images``: random pixels and labels, for speed."""

    _target_: str = "giantpipe.data.image_bundle.random_images"
    """Builder called with the other fields."""
    image_size: int = 224
    """Height and width in pixels."""
    num_classes: int = 1000
    """Label range."""
    batch_size: int = 128
    """Mini-batch size N."""
    epoch_size: int = 1281167
    """Images per "epoch" (ImageNet's), so epoch-valued schedules mean what they would there."""
    seed: int = 0
    """Seed of the pixels and labels."""

    def __post_init__(self) -> None:
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        _check(
            self.epoch_size >= self.batch_size,
            "data.epoch_size",
            f"must be >= data.batch_size ({self.batch_size}), got {self.epoch_size}",
        )


@dataclass
class ImageFolderDataConfig:
    """``giantpipe.data.image_bundle.image_folder``: ImageNet-style train/ and val/ folders."""

    _target_: str = "giantpipe.data.image_bundle.image_folder"
    """Builder called with the other fields."""
    root: str = "data/imagenet"
    """Directory with train/<class>/* and val/<class>/* (or parquet files, with source=hf)."""
    num_classes: int = 1000
    """Class folders expected (checked against the data; the model reads it)."""
    image_size: int = 224
    """Training crop and evaluation crop size in pixels."""
    batch_size: int = 256
    """Mini-batch size N."""
    eval_batch_size: int | None = None
    """Evaluation batch size (null: data.batch_size)."""
    source: str = "imagefolder"
    """``imagefolder`` (torchvision) or ``hf`` (HuggingFace datasets: folders or parquet)."""
    min_scale: float = 0.08
    """Smallest area fraction of a random-resized training crop."""
    hflip: bool = True
    """Random horizontal flips in training."""
    cutout: int = 0
    """Side of the Cutout square in pixels (0: none)."""
    num_workers: int = 8
    """Loader worker processes (0: load in the training process)."""
    cache_dir: str | None = None
    """HuggingFace datasets cache (source=hf)."""

    def __post_init__(self) -> None:
        _check(bool(self.root), "data.root", "must name a directory")
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        if self.eval_batch_size is not None:
            _check_min(self.eval_batch_size, 1, "data.eval_batch_size")
        _check_choice(self.source, ("imagefolder", "hf"), "data.source")
        _check(
            0.0 < self.min_scale <= 1.0,
            "data.min_scale",
            f"must be in (0, 1], got {self.min_scale}",
        )
        _check_min(self.cutout, 0, "data.cutout")
        _check_min(self.num_workers, 0, "data.num_workers")
        _check_optional_path(self.cache_dir, "data.cache_dir")


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
    ("model", "base_transformer_t"): TransformerTModelConfig,
    ("model", "base_transformer_lm"): TransformerLMModelConfig,
    ("data", "base_translation"): TranslationDataConfig,
    ("data", "base_lm_tokens"): LMTokensDataConfig,
    ("model", "base_amoebanet"): AmoebaNetModelConfig,
    ("data", "base_generated_images"): GeneratedImagesDataConfig,
    ("data", "base_random_images"): RandomImagesDataConfig,
    ("data", "base_image_folder"): ImageFolderDataConfig,
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
