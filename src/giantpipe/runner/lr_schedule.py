"""The learning-rate schedule: a pure function ``step -> multiplier of optim.lr``.

``step`` counts optimizer steps from 0: linear warm-up, then constant, cosine, exponential or
inverse-sqrt, so resuming needs nothing but the step; epoch-valued settings are converted with
the data's steps per epoch.

Example::

    factor = lr_multiplier(LRScheduleConfig(name="cosine", warmup_steps=10), 0, 100)
    [round(factor(s), 3) for s in (0, 9, 10, 55, 99)]   # [0.1, 1.0, 1.0, 0.5, 0.0...]
"""

from __future__ import annotations

import math
from collections.abc import Callable

from giantpipe.config import LRScheduleConfig


def epochs_to_steps(epochs: float, steps_per_epoch: float) -> int:
    """Round an epoch count to whole optimizer steps (at least 1 when epochs > 0)."""
    return max(1, round(epochs * steps_per_epoch)) if epochs > 0 else 0


def _decay(
    cfg: LRScheduleConfig, warmup: int, decay_steps: int, total: int
) -> Callable[[int], float]:
    """The rule after warm-up, as a function of the optimizer step."""
    if cfg.name == "cosine":
        span = max(total - warmup, 1)
        return lambda step: (
            cfg.min_ratio
            + (1 - cfg.min_ratio) * 0.5 * (1 + math.cos(math.pi * min((step - warmup) / span, 1.0)))
        )
    if cfg.name == "exponential":
        # e.g. 0.97 every 2.4 epochs; staircase keeps the rate flat within a period.
        def exponential(step: int) -> float:
            periods = (step - warmup) / decay_steps
            return cfg.decay_rate ** (math.floor(periods) if cfg.staircase else periods)

        return exponential
    if cfg.name == "inverse_sqrt":
        # Vaswani et al.: continuous with the warm-up at step = warmup - 1.
        return lambda step: math.sqrt(max(warmup, 1) / (step + 1))
    return lambda step: 1.0


def lr_multiplier(
    cfg: LRScheduleConfig, steps_per_epoch: float, total_steps: int
) -> Callable[[int], float]:
    """``step -> lr multiplier`` for a run of ``total_steps`` optimizer steps.

    Warm-up rises linearly to 1: (step + 1) / warmup, so step 0 already trains.

    Example::

        f = lr_multiplier(LRScheduleConfig(name="exponential", decay_rate=0.5, decay_steps=10,
                                         staircase=True), steps_per_epoch=100, total_steps=50)
        f(9), f(10), f(25)    # 1.0, 0.5, 0.25
    """
    warmup = cfg.warmup_steps or epochs_to_steps(cfg.warmup_epochs, steps_per_epoch)
    decay_steps = cfg.decay_steps or epochs_to_steps(cfg.decay_epochs, steps_per_epoch)
    decay = _decay(cfg, warmup, decay_steps, total_steps)

    def multiplier(step: int) -> float:
        return (step + 1) / warmup if step < warmup else decay(step)

    return multiplier
