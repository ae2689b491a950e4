"""The planner's bounded search: asked for its ``top`` fastest, it returns exactly the head of
the exhaustive ranking (same candidates, same order, same figures) and counts every
configuration that fits, while it reports its progress."""

from __future__ import annotations

import random

import pytest

from giantpipe.perf.costs import LayerCost
from giantpipe.perf.planner import DeviceSpec, plan

DEVICE = DeviceSpec(peak_flops=1e6, memory_bytes=1e9, link_bandwidth=1e7, reserve=0.0)


def layers(seed: int, n: int) -> list[LayerCost]:
    """Uneven layers: FLOPs over two orders of magnitude, some without parameters."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        params = rng.choice([0, rng.randint(1, 10_000)])
        out.append(
            LayerCost(
                flops=rng.uniform(1.0, 100.0) * 1e3,
                params=params,
                param_bytes=4 * params,
                input_bytes=rng.randint(10, 4000),
                saved_bytes=rng.randint(0, 8000),
                input_saved=rng.randint(0, 4000),
                output_bytes=rng.randint(10, 4000),
            )
        )
    return out


# (seed, layers, K, batch, memory per device): budgets from roomy to tight, where the memory
# limit changes the balance and rules configurations out
CASES = [
    (0, 8, 2, 16, 1e9),
    (1, 12, 4, 32, 1e9),
    (2, 12, 4, 32, 4e6),
    (3, 9, 3, 24, 2e6),
    (4, 16, 4, 32, 1.5e6),
    (5, 10, 2, 8, 3e5),
]


@pytest.mark.parametrize(("seed", "n", "k", "batch", "memory"), CASES)
def test_the_bounded_search_returns_the_head_of_the_exhaustive_one(
    seed: int, n: int, k: int, batch: int, memory: float
) -> None:
    model = layers(seed, n)
    device = DeviceSpec(**{**DEVICE.__dict__, "memory_bytes": memory})
    every = plan(model, k, batch, device)
    assert len(every) > 3, "a case the bound cannot make trivial"
    for top in (1, 3, 10):
        head = plan(model, k, batch, device, top=top)
        assert head == every[:top]  # every field (balance, M, mode, step time, peaks...)
        assert [c.samples_per_s for c in head] == [c.samples_per_s for c in every[:top]]
        assert head.fitting == len(every)


def test_measured_times_and_overhead_are_bounded_as_simulated() -> None:
    # The bound must count every second the simulator counts: the executor's overhead per
    # action and the recompute included.
    model = layers(7, 10)
    rng = random.Random(7)
    times = [(rng.uniform(0.1, 1), rng.uniform(0.1, 2), rng.uniform(0, 1)) for _ in model]

    def layer_times(n: int) -> list[tuple[float, float, float]]:
        return [(f * n, b * n, w * n) for f, b, w in times]

    kwargs = {"layer_times": layer_times, "overhead": 0.3}
    every = plan(model, 2, 16, DEVICE, **kwargs)
    assert plan(model, 2, 16, DEVICE, top=5, **kwargs) == every[:5]


def test_progress_is_reported_up_to_the_total() -> None:
    seen: list[tuple[int, int]] = []
    plan(
        layers(0, 8), 2, 16, DEVICE, top=3, progress=lambda done, total: seen.append((done, total))
    )
    dones = [done for done, _ in seen]
    assert dones == sorted(dones) and seen[-1][0] == seen[-1][1] > 0
    assert {total for _, total in seen} == {seen[-1][1]}
