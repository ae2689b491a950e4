"""The simulator on cases worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.fill_drain import expected_bubble, fill_drain
from giantpipe.engine.schedules.one_f_one_b import interleaved, one_f_one_b, zb_h1, zb_v
from giantpipe.perf.simulate import StageCost, simulate
from giantpipe.perf.timeline import plot_timeline, render_text


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_equal_costs_give_the_fill_drain_bubble(name: str, k: int, m: int) -> None:
    sim = simulate(build_schedule(name, k, m), [StageCost(forward=1.0, backward=2.0)] * k)
    assert sim.step_time == pytest.approx(3.0 * (m + k - 1))
    assert sim.bubble == pytest.approx((k - 1) / (m + k - 1))
    assert sim.busy == [3.0 * m] * k


@pytest.mark.parametrize(("k", "v", "m"), [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 2, 16)])
def test_interleaved_divides_the_bubble_by_v(k: int, v: int, m: int) -> None:
    # the same model cut V times finer: each stage costs 1/V of a worker's share
    sim = simulate(interleaved(k, m, v), [StageCost(1.0 / v, 2.0 / v)] * (k * v))
    assert sim.bubble == pytest.approx(expected_bubble(k, m, v))


@pytest.mark.parametrize(("k", "m"), [(2, 2), (3, 4), (4, 8), (8, 16)])
def test_zb_h1_bubble_is_k_minus_1_times_f_plus_b_minus_w(k: int, m: int) -> None:
    cost = StageCost(forward=1.0, backward=2.0, backward_input=1.0, weight=1.0)
    sim = simulate(zb_h1(k, m), [cost] * k)
    assert sim.step_time == pytest.approx(3.0 * m + (k - 1) * (1.0 + 1.0 - 1.0))
    one = simulate(one_f_one_b(k, m), [cost] * k)
    assert one.step_time == pytest.approx(3.0 * (m + k - 1))


@pytest.mark.parametrize(("k", "m", "idle"), [(2, 4, 1), (2, 8, 1), (4, 8, 3), (4, 16, 3)])
def test_zb_v_idles_only_while_the_first_forward_fills(k: int, m: int, idle: int) -> None:
    # Half stages (F = B = W = 1 each, a whole stage's 2): ZB-V's step is the work, 6M, plus
    # the K-1 ticks the last worker waits for micro-batch 0; ZB-H1 on whole stages pays
    # (K-1)(F+B-W) = 2(K-1)
    half = StageCost(forward=1.0, backward=2.0, backward_input=1.0, weight=1.0)
    assert simulate(zb_v(k, m), [half] * (2 * k)).step_time == pytest.approx(6.0 * m + idle)
    whole = StageCost(forward=2.0, backward=4.0, backward_input=2.0, weight=2.0)
    assert simulate(zb_h1(k, m), [whole] * k).step_time == pytest.approx(6.0 * m + 2 * (k - 1))


def test_send_time_is_paid_on_each_boundary_crossing() -> None:
    costs = [StageCost(1.0, 2.0, send=0.5), StageCost(1.0, 2.0)]
    sim = simulate(fill_drain(2, 1), costs)
    assert sim.step_time == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    # stages of one worker (looped schedules) hand over for free
    looped = simulate(fill_drain(1, 1, virtual_stages=2), costs)
    assert looped.step_time == pytest.approx(6.0)


def test_recompute_overlaps_the_wait_for_the_gradient() -> None:
    costs = [StageCost(forward=1.0, backward=2.0, recompute=1.0)] * 2
    never = simulate(fill_drain(2, 1), costs, recompute="never")
    always = simulate(fill_drain(2, 1), costs, recompute="always")
    # F F B B = 6; with 'always' the last stage's replay is on the critical path (+1), but
    # stage 0 replays its forward while stage 1 runs its backward: no extra time
    assert never.step_time == pytest.approx(6.0)
    assert always.step_time == pytest.approx(7.0)
    assert always.busy == [4.0, 4.0] and never.busy == [3.0, 3.0]
    last = simulate(fill_drain(1, 1), costs[:1], recompute="always")
    assert last.step_time == pytest.approx(4.0)  # nothing to overlap with


def test_contention_slows_only_actions_that_overlap() -> None:
    # K=2, M=2, F = B = 1, twice as slow when both workers run: F0@0 alone (1), F1@0 with
    # F0@1 (2), F1@1 alone (1), B1@1 alone (1), B1@0 with B0@1 (2), B0@0 alone (1)
    costs = [StageCost(1.0, 1.0)] * 2
    assert simulate(fill_drain(2, 2), costs).step_time == pytest.approx(6.0)
    slowed = simulate(fill_drain(2, 2), costs, contention=2.0)
    assert slowed.step_time == pytest.approx(8.0)
    assert slowed.busy == [pytest.approx(6.0)] * 2  # busy time includes the slowdown


def test_overhead_is_added_to_every_action() -> None:
    sim = simulate(fill_drain(1, 3), [StageCost(1.0, 1.0)], overhead=0.1)
    assert sim.step_time == pytest.approx(6 * 1.1)


def test_peak_memory_per_schedule_and_mode() -> None:
    cost = StageCost(1.0, 2.0, input_bytes=10, activation_bytes=100, static_bytes=1000)
    k, m = 3, 6
    assert simulate(fill_drain(k, m), [cost] * k).peak_activation_bytes == [m * 110] * k
    always = simulate(fill_drain(k, m), [cost] * k, recompute="always")
    assert always.peak_activation_bytes == [m * 10 + 100] * k
    assert always.peak_memory_bytes == [m * 10 + 100 + 1000] * k
    last = simulate(fill_drain(k, m), [cost] * k, recompute="except_last")
    assert last.peak_activation_bytes == [(m - 1) * 10 + 110] * k  # B5 frees before B4 replays
    one = simulate(one_f_one_b(k, m), [cost] * k)
    assert one.peak_activation_bytes == [(k - s) * 110 for s in range(k)]
    zb = simulate(zb_h1(k, m), [cost] * k)
    assert zb.peak_activation_bytes == [k * 110] * k
    il = simulate(interleaved(2, 4, 2), [cost] * 4)
    assert il.peak_memory_bytes[0] == 2 * 1000 + il.peak_activation_bytes[0]


def test_text_timelines() -> None:
    unit = StageCost(forward=1.0, backward=1.0, backward_input=1.0, weight=1.0)
    assert render_text(simulate(one_f_one_b(3, 4), [unit] * 3)).splitlines() == [
        "worker 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
        "worker 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .",
        "worker 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .",
    ]
    assert render_text(simulate(zb_h1(3, 4), [unit] * 3)).splitlines() == [
        "worker 0 | F0 F1 F2 .  .  B0 W0 F3 B1 W1 B2 W2 B3 W3",
        "worker 1 | .  F0 F1 .  B0 F2 B1 W0 F3 B2 W1 B3 W2 W3",
        "worker 2 | .  .  F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3",
    ]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    cost = StageCost(1.0, 2.0, recompute=1.0)
    sim = simulate(zb_h1(3, 4), [cost] * 3, recompute="always")
    out = plot_timeline(sim, tmp_path / "zb.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_count_must_match_stages() -> None:
    with pytest.raises(ValueError, match="2 stage costs for 4 stages"):
        simulate(interleaved(2, 2, 2), [StageCost(1.0, 1.0)] * 2)
