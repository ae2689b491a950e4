"""Timing that holds on a busy machine, and timing that counts the backward.

The clock is injected: each test layer moves a fake clock by a fixed amount in its forward and
in its backward (a custom autograd Function), so what lies inside the timed window and how the
repeated timings are summarised are checked exactly, with no real timing."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe.perf.balance import (
    balance_by_params,
    balance_by_time,
    profile_times,
    solve_balance,
    untrusted_layers,
)
from giantpipe.perf.stage_profile import TimingNoise, profile_stages, spread


class FakeClock:
    """Seconds that move only when a test layer says so; shared, never copied (the profiler
    deep-copies each layer)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def __deepcopy__(self, memo: dict[int, Any]) -> FakeClock:
        return self


class _Spend(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Costly) -> torch.Tensor:
        ctx.layer = layer
        layer.clock.now += next(layer.forward_costs)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.layer.clock.now += ctx.layer.backward_cost
        return grad.clone(), None


class Costly(nn.Module):
    """A Linear whose forward and backward take the given (fake) seconds; ``forward`` may be a
    list of seconds, used in turn (a noisy machine)."""

    def __init__(self, clock: FakeClock, forward: float | list[float], backward: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.clock, self.backward_cost = clock, backward
        self._forward = forward if isinstance(forward, list) else [forward]
        self.forward_costs: Iterator[float] = itertools.cycle(self._forward)

    def __deepcopy__(self, memo: dict[int, Any]) -> Costly:
        copy = Costly(self.clock, list(self._forward), self.backward_cost)
        copy.linear.load_state_dict(self.linear.state_dict())
        return copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Spend.apply(self.linear(x), self)


SAMPLE = torch.randn(2, 4)


def test_a_layer_whose_cost_lies_in_backward_gets_its_own_stage() -> None:
    # forward + backward: [2, 2, 20.1, 2, 2, 2]; the forward alone: [1, 1, 0.1, 1, 1, 1]
    clock = FakeClock()
    costs = [(1.0, 1.0)] * 2 + [(0.1, 20.0)] + [(1.0, 1.0)] * 3
    model = nn.Sequential(*[Costly(clock, f, b) for f, b in costs])
    times = profile_times(model, SAMPLE, torch.device("cpu"), clock=clock)
    assert times == pytest.approx([2.0, 2.0, 20.1, 2.0, 2.0, 2.0])
    assert balance_by_time(3, model, SAMPLE, clock=clock) == [2, 1, 3]


def test_the_planners_stage_profile_puts_backward_cost_in_backward() -> None:
    clock = FakeClock()
    stage = nn.Sequential(Costly(clock, 0.1, 20.0), Costly(clock, 1.0, 1.0))
    (cost,) = profile_stages([stage], [torch.device("cpu")], SAMPLE, clock=clock)
    assert cost.forward == pytest.approx(1.1)
    assert cost.backward == pytest.approx(21.0)
    assert cost.backward_input + cost.weight == pytest.approx(21.0)


def test_balance_by_time_takes_the_median_of_the_repeats() -> None:
    # One disturbed run in five (a burst of load) moves a mean, not the median; the spread of
    # the runs stays small, so the times are trusted.
    clock = FakeClock()
    layers = [Costly(clock, 1.0, 0.0) for _ in range(4)]
    layers[0] = Costly(clock, [1.0, 1.0, 1.0, 1.0, 1.0, 40.0], 0.0)  # warm-up, then 5 runs
    model = nn.Sequential(*layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TimingNoise)
        assert balance_by_time(2, model, SAMPLE, repeats=5, clock=clock) == [2, 2]


def noisy_model(clock: FakeClock) -> nn.Sequential:
    """Layer 0's runs spread wide (IQR over median 1.6); by time it would sit alone."""
    runs = [1.0, 1.0, 9.0, 1.0, 9.0, 5.0]  # the warm-up, then 1 9 1 9 5: median 5
    layers = [Costly(clock, 1.0, 0.0) for _ in range(4)]
    layers[0] = Costly(clock, runs, 0.0)
    return nn.Sequential(*layers)


def test_noisy_timings_are_named_and_balanced_by_the_fallback() -> None:
    clock = FakeClock()
    model = noisy_model(clock)
    by_median = solve_balance([5.0, 1.0, 1.0, 1.0], 2)  # [1, 3]
    # every layer holds one 4x4 Linear: the same FLOPs and parameters each
    with pytest.warns(TimingNoise, match=r"layer 0 \(Costly, 160%\).*forward FLOPs"):
        by_flops = balance_by_time(2, model, SAMPLE, clock=clock)
    assert by_flops == [2, 2] != by_median
    with pytest.warns(TimingNoise, match="parameter count"):
        assert balance_by_time(2, model, SAMPLE, fallback="params", clock=clock) == (
            balance_by_params(2, model)
        )
    with pytest.warns(TimingNoise, match="medians anyway"):
        assert balance_by_time(2, model, SAMPLE, fallback="time", clock=clock) == by_median


def test_a_cut_that_moves_from_run_to_run_is_not_trusted() -> None:
    # Layer 0 takes 2.1 or 1.6 s (a spread of 24%, under max_spread): by the median (2.1) the
    # cut is [1, 3], but the 1.6 s runs alone give [2, 2]: a near tie that load decides.
    clock = FakeClock()
    layers = [Costly(clock, 1.0, 0.0) for _ in range(4)]
    layers[0] = Costly(clock, [2.1, 2.1, 1.6, 2.1, 1.6, 2.1], 0.0)  # warm-up, then 5 runs
    model = nn.Sequential(*layers)
    with pytest.warns(TimingNoise, match=r"cut moves from run to run .* 60% .*layer 0 \(Costly"):
        assert balance_by_time(2, model, SAMPLE, clock=clock) == [2, 2]  # by FLOPs: all equal
    with pytest.warns(TimingNoise, match="medians anyway"):
        assert balance_by_time(2, model, SAMPLE, fallback="time", clock=clock) == [1, 3]


def test_the_planners_measurements_name_a_noisy_stage() -> None:
    clock = FakeClock()
    stage = nn.Sequential(Costly(clock, [1.0, 1.0, 9.0, 1.0, 9.0, 5.0], 1.0))
    with pytest.warns(TimingNoise, match=r"layer 3 \(x\): timings spread .*forward"):
        profile_stages(
            [stage], [torch.device("cpu")], SAMPLE, repeats=5, clock=clock, names=["layer 3 (x)"]
        )


def test_spread_and_untrusted_layers_are_pure_functions() -> None:
    assert spread([2.0, 2.0, 2.0]) == 0.0
    assert spread([1.0, 1.0, 2.0, 3.0, 3.0]) == 1.0
    quiet, busy, tiny = [1.0, 1.1, 1.0, 1.05, 1.0], [1.0, 3.0, 1.0, 3.0, 2.0], [0.0, 1e-4, 0.0]
    assert untrusted_layers([quiet, busy, tiny]) == [1]  # the tiny one cannot move a cut
    assert untrusted_layers([quiet, busy], max_spread=2.0) == []
