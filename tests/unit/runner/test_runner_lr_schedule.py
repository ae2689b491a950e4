"""Learning-rate schedules: warm-up, cosine, exponential (staircase), inverse square root."""

import math

import pytest

from giantpipe.config import LRScheduleConfig
from giantpipe.runner.lr_schedule import epochs_to_steps, lr_multiplier


def test_linear_warmup_then_constant():
    f = lr_multiplier(LRScheduleConfig(name="constant", warmup_steps=4), 10, 100)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_reaches_min_ratio_at_the_end():
    f = lr_multiplier(LRScheduleConfig(name="cosine", warmup_steps=10, min_ratio=0.1), 10, 110)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)


def test_exponential_staircase_every_2_4_epochs():
    # AmoebaNet: 0.97 every 2.4 epochs; 100 steps per epoch -> a jump every 240 steps.
    cfg = LRScheduleConfig(name="exponential", decay_rate=0.97, decay_epochs=2.4, staircase=True)
    f = lr_multiplier(cfg, steps_per_epoch=100, total_steps=10_000)
    assert f(239) == 1.0
    assert f(240) == pytest.approx(0.97)
    assert f(479) == pytest.approx(0.97)
    assert f(480) == pytest.approx(0.97**2)


def test_exponential_continuous_with_epoch_warmup():
    cfg = LRScheduleConfig(name="exponential", warmup_epochs=1, decay_rate=0.5, decay_steps=10)
    f = lr_multiplier(cfg, steps_per_epoch=20, total_steps=100)
    assert f(0) == pytest.approx(1 / 20)
    assert f(20) == 1.0
    assert f(25) == pytest.approx(0.5**0.5)


def test_inverse_sqrt_is_continuous_after_warmup():
    f = lr_multiplier(LRScheduleConfig(name="inverse_sqrt", warmup_steps=100), 10, 10_000)
    assert f(99) == pytest.approx(1.0)
    assert f(399) == pytest.approx(0.5)
    assert f(1599) == pytest.approx(0.25)


def test_epochs_to_steps_rounds_and_never_returns_zero_for_positive_epochs():
    assert epochs_to_steps(2.4, 100) == 240
    assert epochs_to_steps(0.001, 10) == 1
    assert epochs_to_steps(0.0, 10) == 0
    assert math.isclose(epochs_to_steps(3, 33.5), 100)
