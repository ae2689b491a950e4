"""Whether a pipeline fits: the pools' verdict (an exact table), and the forecast of a fixed
balance worked out by hand and set against the planner's own for the same configuration."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from giantpipe.engine.spec import PipelineSpec
from giantpipe.perf.costs import DeviceModel, LayerCost, measure_layers
from giantpipe.perf.fit import Shortfall, forecast, shortfalls
from giantpipe.perf.planner import DeviceSpec, plan

HOST, GPU0, GPU1 = "host", "cuda:0", "cuda:1"


@pytest.mark.parametrize(
    ("peaks", "members", "capacity", "expected"),
    [
        # two stand-ins share the host: their peaks add up; exactly full fits
        ([3, 2, 4], [(0, HOST), (1, HOST), (2, GPU0)], {HOST: 5, GPU0: 4}, []),
        (
            [3, 2, 4],
            [(0, HOST), (1, HOST), (2, GPU0)],
            {HOST: 4, GPU0: 4},
            [Shortfall(HOST, (0, 1), 5, 4)],
        ),
        # a GPU holds only its own worker: the other GPU's room does not help
        ([5, 3], [(0, GPU0), (1, GPU1)], {GPU0: 4, GPU1: 100}, [Shortfall(GPU0, (0,), 5, 4)]),
        (
            [5, 5],
            [(0, GPU0), (1, GPU1)],
            {GPU0: 4, GPU1: 4},
            [Shortfall(GPU0, (0,), 5, 4), Shortfall(GPU1, (1,), 5, 4)],
        ),
        # torchrun, K=2 x R=2 CPU ranks on one host: each worker's peak counts once per rank
        (
            [3, 2],
            [(0, HOST), (1, HOST), (0, HOST), (1, HOST)],
            {HOST: 9},
            [Shortfall(HOST, (0, 1, 0, 1), 10, 9)],
        ),
        ([3, 2], [(0, HOST), (1, HOST), (0, HOST), (1, HOST)], {HOST: 10}, []),
        # a rank checks only its own device (worker 1): worker 0's peak is another rank's
        ([100, 1], [(1, GPU1)], {GPU1: 2}, []),
        ([100, 3], [(1, GPU1)], {GPU1: 2}, [Shortfall(GPU1, (1,), 3, 2)]),
    ],
)
def test_shortfalls_table(peaks, members, capacity, expected) -> None:
    assert shortfalls(peaks, members, capacity) == expected


ZERO_TIMES = DeviceModel(peak_flops=1e12, memory_bandwidth=math.inf).layer_times


def one_layer(param_bytes: int, input_bytes: int, saved_bytes: int) -> LayerCost:
    return LayerCost(
        flops=0.0,
        params=param_bytes // 4,
        param_bytes=param_bytes,
        input_bytes=input_bytes,
        saved_bytes=saved_bytes,
        input_saved=0,
        output_bytes=input_bytes,
    )


@pytest.mark.parametrize(
    ("recompute", "slots", "peak"),
    [
        # weights + grads 2 x 40; GPipe holds both micro-batches (2 samples each) before the
        # first backward: 2 x (input 2 x 8 + saved 2 x 16)
        ("never", 0, 80 + 2 * (16 + 32)),
        # Adam's two slots: 4 x 40 resident
        ("never", 2, 160 + 2 * (16 + 32)),
        # re-materialized: only the inputs stay, one micro-batch's activations come back
        ("always", 0, 80 + 2 * 16 + 32),
    ],
)
def test_forecast_of_a_fixed_balance_by_hand(recompute: str, slots: int, peak: int) -> None:
    layers = [one_layer(40, 8, 16), one_layer(40, 8, 16)]
    spec = PipelineSpec((1, 1), chunks=2, recompute=recompute)
    sim = forecast(
        layers, spec, batch_size=4, optimizer_slots=slots, layer_times=ZERO_TIMES(layers)
    )
    assert sim.peak_memory_bytes == [peak, peak]


def test_forecast_equals_the_planners_own_peaks_and_step() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)], nn.Linear(32, 4))
    layers = measure_layers(model, torch.empty(1, 32, device="meta"))
    times = DeviceModel(peak_flops=1e9, memory_bandwidth=1e9).layer_times(layers)
    device = DeviceSpec(1.0, math.inf, link_bandwidth=math.inf, link_latency=0.0)
    for schedule, recompute in [("gpipe", "never"), ("1f1b", "always"), ("zb-h1", "except_last")]:
        (best,) = plan(
            layers,
            2,
            8,
            device,
            schedules=[schedule],
            chunks=[4],
            recompute=[recompute],
            optimizer_slots=2,
            layer_times=times,
            top=1,
        )
        sim = forecast(layers, best.spec(), 8, 2, times)
        assert sim.peak_memory_bytes == best.peak_memory_bytes
        assert sim.step_time == pytest.approx(best.step_time_s)
