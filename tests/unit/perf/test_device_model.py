"""The device model behind the paper tables (:class:`giantpipe.perf.costs.DeviceModel`):
FLOPs at an efficiency that grows with the micro-batch, memory traffic, per-layer overhead."""

from __future__ import annotations

import math

import pytest

from giantpipe.perf.costs import DeviceModel, LayerCost


def _layer(flops: float, params: int = 1, saved: int = 0) -> LayerCost:
    return LayerCost(flops=flops, params=params, param_bytes=4 * params, input_bytes=100,
                     saved_bytes=saved, input_saved=0, output_bytes=100)  # fmt: skip


def test_device_model_times_flops_bytes_and_overhead_per_action() -> None:
    device = DeviceModel(peak_flops=1e12, memory_bandwidth=1e10, efficiency=0.5,
                         layer_overhead=1e-5)  # fmt: skip
    first, conv = _layer(1e9), _layer(1e9, saved=1000)
    f, b, w = device.layer_times([first, conv])(8)[1]
    compute = 8e9 / 0.5e12
    assert f == pytest.approx(compute + 8 * 1200 / 1e10 + 1e-5)
    assert b == f and w == pytest.approx(compute + 8 * 1000 / 1e10)
    assert device.layer_times([first, conv])(8)[0][1] == 0.0  # the input needs no gradient


def test_layers_without_flops_cost_their_memory_traffic() -> None:
    # BatchNorm, ReLU and pooling: no matmul FLOPs, but every byte read and written
    device = DeviceModel(peak_flops=1e12, memory_bandwidth=1e9)
    relu = _layer(0.0, params=0, saved=400)
    f, b, w = device.layer_times([_layer(1.0), relu])(10)[1]
    assert f == b == pytest.approx(10 * (100 + 400 + 100) / 1e9) and w == 0.0


def test_efficiency_grows_with_the_micro_batch() -> None:
    device = DeviceModel(peak_flops=1e12, memory_bandwidth=math.inf, efficiency=0.8,
                         half_batch=4)  # fmt: skip
    assert device.efficiency_at(4) == pytest.approx(0.4)
    per_sample = [device.layer_times([_layer(1e9)])(n)[0][0] / n for n in (1, 4, 64)]
    assert per_sample[0] > per_sample[1] > per_sample[2] > 1e9 / 0.8e12
    flat = DeviceModel(peak_flops=1e12, memory_bandwidth=math.inf, efficiency=0.8)
    assert flat.efficiency_at(1) == flat.efficiency_at(64) == 0.8
