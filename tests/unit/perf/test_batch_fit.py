"""The batch search (giantpipe.perf.batch_fit): batches M, 2M, 4M, ... while the planner finds a
cut that fits, the fastest by the caller's rate, with the cut the planner chose for it.

Four equal layers of 4000 parameter bytes (x 3: weights, gradients, one optimizer slot), K=2,
M=4, re-materialization 'always'. The first layer is timed three times the others, so the
fastest cut is [1, 3] while it fits; with more samples only [2, 2] does. Peaks of the busiest
device (the planner's memory model): [1, 3] 51000, 66000 and 96000 bytes for 4, 8 and 16
samples; [2, 2] 24000 + 11000 per sample of a micro-batch (112000 for 32 samples).
"""

from __future__ import annotations

from collections.abc import Sequence

from giantpipe.perf.batch_fit import Fit, fastest_batch
from giantpipe.perf.costs import LayerCost
from giantpipe.perf.planner import DeviceSpec

LAYER = LayerCost(flops=1e6, params=1000, param_bytes=4000, input_bytes=1000, saved_bytes=3000,
                  input_saved=1000, output_bytes=1000)  # fmt: skip
LAYERS = [LAYER] * 4


def times(n: int) -> list[tuple[float, float, float]]:
    return [(3e-3 * n,) * 3] + [(1e-3 * n,) * 3] * 3


def device(memory_bytes: float) -> DeviceSpec:
    return DeviceSpec(peak_flops=1e12, memory_bytes=memory_bytes, link_bandwidth=1e9, reserve=0.0)


def test_the_fastest_batch_that_fits_wins_and_the_search_stops_at_the_first_that_does_not() -> None:
    tried: list[tuple[int, tuple[int, ...]]] = []

    def rate(batch: int, balance: Sequence[int]) -> float:  # fastest at 8 samples
        tried.append((batch, tuple(balance)))
        return float(batch * (20 - batch))

    # 4, 8 and 16 samples fit 1e5 bytes cut [1, 3]; 32 samples no cut at all
    fit = fastest_batch(LAYERS, 2, 4, device(1e5), times, rate, max_batch=1024)
    assert fit == Fit(batch=8, samples_per_s=96.0, balance=(1, 3))
    assert tried == [(4, (1, 3)), (8, (1, 3)), (16, (1, 3))]  # 64 and beyond: never tried


def test_a_larger_batch_takes_the_cut_that_fits_it() -> None:
    tried: list[tuple[int, tuple[int, ...]]] = []

    def rate(batch: int, balance: Sequence[int]) -> float:
        tried.append((batch, tuple(balance)))
        return float(batch)

    # 32 samples: [1, 3] no longer fits 1.2e5 bytes, [2, 2] does (112000); 64 samples: nothing
    fit = fastest_batch(LAYERS, 2, 4, device(1.2e5), times, rate, max_batch=1024)
    assert fit == Fit(batch=32, samples_per_s=32.0, balance=(2, 2))
    assert tried == [(4, (1, 3)), (8, (1, 3)), (16, (1, 3)), (32, (2, 2))]


def test_nothing_fits_below_m_samples_or_when_the_weights_alone_do_not() -> None:
    def rate(batch: int, balance: Sequence[int]) -> float:
        return 1.0

    assert fastest_batch(LAYERS, 2, 4, device(1e5), times, rate, max_batch=2) is None
    assert fastest_batch(LAYERS, 2, 4, device(3e4), times, rate, max_batch=1024) is None
