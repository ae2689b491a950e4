"""The planner: per-layer costs on the meta device, memory pressure of each schedule, the
constrained balance, and plans for cases worked out by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from giantpipe.engine.schedules import build_schedule
from giantpipe.perf.balance import NoFit, solve_balance
from giantpipe.perf.costs import LayerCost, measure_layers
from giantpipe.perf.planner import DeviceSpec, format_table, memory_unit, plan, pressure


def test_measure_layers_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    costs = measure_layers(model, torch.empty(1, 8, device="meta"))
    assert [c.flops for c in costs] == [2 * 8 * 16, 0, 2 * 16 * 4]
    assert [c.params for c in costs] == [8 * 16 + 16, 0, 16 * 4 + 4]
    assert [c.input_bytes for c in costs] == [32, 64, 64]
    assert [c.output_bytes for c in costs] == [64, 64, 16]
    # ReLU saves its output, the loss keeps the logits; each Linear saves its input for its
    # weight gradient (even the first, whose input needs no gradient of its own)
    assert [c.saved_bytes for c in costs] == [0, 64, 16]
    assert [c.input_saved for c in costs] == [32, 0, 64]


def test_pressure_reads_in_flight_counts_off_the_schedule() -> None:
    gpipe = build_schedule("gpipe", 2, 3)
    assert pressure(gpipe, "never") == [[(3, 3)], [(3, 3)]]
    assert pressure(gpipe, "always") == [[(3, 1)], [(3, 1)]]
    one = build_schedule("1f1b", 2, 3)
    assert pressure(one, "never") == [[(2, 2)], [(1, 1)]]
    zb = build_schedule("zb-h1", 2, 3)
    assert pressure(zb, "never") == [[(2, 2)], [(2, 2)]]


def test_min_max_balance_is_exact_and_honours_memory() -> None:
    times = [1.0, 1.0, 1.0, 5.0, 1.0, 1.0]
    free = solve_balance(times, 3, fits=lambda s, j, i: True)
    assert free == solve_balance(times, 3) == [3, 1, 2]
    # at most two layers per stage: the cut must change, and the bottleneck grows
    assert solve_balance(times, 3, fits=lambda s, j, i: i - j <= 2.0) == [2, 2, 2]
    with pytest.raises(NoFit):
        solve_balance(times, 2, fits=lambda s, j, i: i - j <= 2.0)


def layer(flops: float = 1.0, params: int = 1) -> LayerCost:
    return LayerCost(
        flops, params, 4 * params, input_bytes=10, saved_bytes=100, input_saved=10, output_bytes=10
    )


def test_plan_by_hand() -> None:
    # 4 equal layers on 2 devices, 1 FLOP per layer and sample at 1 FLOP/s, free links and no
    # overhead: per micro-batch of one sample, stage 1 has F = 2 s, B = 2 s, W = 2 s; stage 0
    # the same but B = 1 s (the model's first layer computes no input gradient).
    device = DeviceSpec(
        peak_flops=1.0,
        memory_bytes=1e9,
        link_bandwidth=1e30,
        link_latency=0.0,
        efficiency=1.0,
        layer_overhead=0.0,
        reserve=0.0,
    )
    layers = [layer() for _ in range(4)]
    zb = plan(layers, 2, 8, device, recompute=["never"], schedules=["zb-h1"])[0]
    assert zb.balance == [2, 2] and zb.chunks == 8
    # zero bubble: stage 1 works 8 x 6 s without a break after stage 0's first F (2 s);
    # 1F1B adds stage 0's last full backward (3 s) after stage 1's
    assert zb.step_time_s == pytest.approx(2 + 8 * 6)
    one = next(c for c in plan(layers, 2, 8, device, schedules=["1f1b"]) if c.chunks == 8)
    assert one.step_time_s == pytest.approx(2 + 8 * 6 + 3)
    # ZB-V (one layer per half stage, worker 0 holding the first and the last) waits only for
    # the first layer's F (1 s), at the same activation memory: the best of all schedules
    best = plan(layers, 2, 8, device, recompute=["never"])[0]
    assert (best.schedule, best.balance, best.chunks) == ("zb-v", [1, 1, 1, 1], 8)
    assert best.step_time_s == pytest.approx(1 + 8 * 6)
    assert best.peak_memory_bytes == zb.peak_memory_bytes
    # the planner's output is the spec both pipes take: its knobs, and the fields it does not
    # choose as given
    spec = best.spec(devices=("cpu", "cpu"), timeout=60.0)
    assert (spec.balance, spec.chunks, spec.schedule, spec.virtual_stages, spec.recompute) == (
        (1, 1, 1, 1), 8, "zb-v", 2, "never",
    )  # fmt: skip
    assert (spec.devices, spec.timeout, spec.num_workers) == (("cpu", "cpu"), 60.0, 2)
    assert best.samples_per_s == pytest.approx(8 / best.step_time_s)


def test_measured_layer_times_replace_the_device_model() -> None:
    # the device model gives every layer the same time (it would cut [2, 2]); measured, the
    # first layer is 5x slower (linear in the micro-batch), so the cut moves to [1, 3]
    device = DeviceSpec(peak_flops=1.0, memory_bytes=1e9, link_bandwidth=1e30, link_latency=0.0,
                        efficiency=1.0, layer_overhead=0.0, reserve=0.0)  # fmt: skip
    asked: list[int] = []

    def measured(n: int) -> list[tuple[float, float, float]]:
        asked.append(n)
        return [(5.0 * n, 0.0, 5.0 * n)] + [(1.0 * n, 1.0 * n, 1.0 * n)] * 3

    layers = [layer() for _ in range(4)]
    one = dict(schedules=["gpipe"], chunks=[2], recompute=["never"], layer_times=measured)
    best = plan(layers, 2, 4, device, **one)[0]
    assert best.balance == [1, 3]
    # micro-batches of 2: stage 0 F = 10 s, B+W = 10 s; stage 1 F = 6 s, B+W = 12 s. Fill-drain:
    # stage 0's two F (20 s), stage 1's last F (6 s), its two backward (24 s), stage 0's last (10 s)
    assert best.step_time_s == pytest.approx(20 + 6 + 24 + 10)
    assert asked == [2]  # one measurement per micro-batch size, shared by modes and schedules
    slower = plan(layers, 2, 4, device, **one, overhead=0.5)[0]
    assert slower.step_time_s == pytest.approx(60 + 6 * 0.5)  # 6 actions on the critical path


def test_plan_drops_what_does_not_fit_and_counts_optimizer_state() -> None:
    device = DeviceSpec(peak_flops=1.0, memory_bytes=2000, link_bandwidth=1e9, reserve=0.0)
    layers = [layer(params=100) for _ in range(4)]  # 400 B of weights per layer
    candidates = plan(layers, 2, 4, device, optimizer_slots=0)  # 2 x 400 B x 2 layers = 1600
    assert candidates and all(max(c.peak_memory_bytes) <= 2000 for c in candidates)
    assert {c.recompute for c in candidates if c.schedule == "gpipe" and c.chunks == 4} == {
        "always",
        "except_last",
    }  # 'never' holds 4 x (10 + 2 x 100 + 10) = 880 B next to 1600, 'always' 4 x 10 + 210
    assert plan(layers, 2, 4, device, optimizer_slots=2) == []  # 400 x 4 = 1600 per layer


def test_the_table_shows_a_small_models_memory_in_a_unit_it_reads_in() -> None:
    """The planner's table printed 0.0 GiB per device for the MLP quick start."""
    device = DeviceSpec(peak_flops=1e12, memory_bytes=16 * 2**30, link_bandwidth=1e10)
    best = plan([layer() for _ in range(4)], 2, 8, device)[:3]
    largest = max(b for c in best for b in c.peak_memory_bytes)
    unit, size = memory_unit(largest)
    assert unit in ("B", "KiB", "MiB") and 1 <= largest / size < 1024
    table = format_table(best).splitlines()
    assert table[0].endswith(f"| peak {unit} per device |")
    for row, candidate in zip(table[2:], best, strict=True):
        shown = [float(v) for v in row.rstrip(" |").rpartition("|")[2].split()]
        assert shown == [round(b / size, 1) for b in candidate.peak_memory_bytes]
        assert all(v > 0 for v in shown)
