"""The optimizer and its learning-rate schedule: the ``optim`` group's schema.

Example::

    from giantpipe.config import OptimConfig, LRScheduleConfig

    OptimConfig(name="sgd", lr=0.1, momentum=0.9,
                lr_schedule=LRScheduleConfig(name="cosine", warmup_steps=100))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from giantpipe.config.checks import check, check_choice, check_fields_finite, check_fp32, check_min

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
LR_SCHEDULES = ("constant", "cosine", "exponential", "inverse_sqrt")


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
