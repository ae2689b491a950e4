"""The replica sharding the planner picks: the least sharded mode that fits the budget, by exact
tables, and why in words; the leanest configuration when nothing fits."""

from __future__ import annotations

import math

import pytest

from giantpipe.perf.costs import LayerCost
from giantpipe.perf.planner import DeviceSpec, plan
from giantpipe.perf.replica_state import ReplicaSharding
from giantpipe.perf.sharding_choice import SHARDING_ORDER, choose_sharding

MIB = 2**20
LAYER = LayerCost(1e6, 2**18, MIB, input_bytes=64, saved_bytes=64, input_saved=0, output_bytes=64)
"""1 MiB of weights, next to no activations: eight of them on K=2 devices, four a stage."""


def choose(replicas: int, slots: int, budget_mib: float):
    device = DeviceSpec(1e12, memory_bytes=budget_mib * MIB, link_bandwidth=1e9, reserve=0.0)
    search = lambda s: plan([LAYER] * 8, 2, 4, device, replicas=s, optimizer_slots=slots)  # noqa: E731
    return choose_sharding(search, replicas)


# A stage of four 1 MiB layers holds at its peak (replica_state.py's formulas, slots s):
#   none (3 + s) w, grads 2w + (2 + s) w / R, full (2 + s) w / R + 3w (one layer gathered, its
#   gradients and a reduce's input)
# so with R = 2 and RMSProp (s = 1): none 16 MiB, grads 14, full 9 (zb-h1 and zb-v keep full's
# layers gathered, as grads does: 14); the few bytes of activations tip an exact budget over.
@pytest.mark.parametrize(
    ("replicas", "slots", "budget", "mode", "schedules"),
    [
        (2, 1, 24, "none", {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}),
        (2, 1, 17, "none", {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}),
        (2, 1, 16, "grads", {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}),
        (2, 1, 15, "grads", {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}),
        (2, 1, 14, "full", {"gpipe", "1f1b", "interleaved"}),  # V=2: 2 x (3 + 3) MiB
        (2, 1, 12, "full", {"gpipe", "1f1b"}),
        (2, 1, 10, "full", {"gpipe", "1f1b"}),
        (2, 1, 9, None, set()),
        (4, 1, 12, "grads", {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}),  # grads: 11
        (4, 1, 11, "full", {"gpipe", "1f1b", "interleaved"}),  # full: 6, V=2 9
        (4, 1, 9, "full", {"gpipe", "1f1b"}),
        (4, 1, 7, "full", {"gpipe", "1f1b"}),
        (4, 1, 6, None, set()),
        (2, 2, 24, "none", {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}),  # Adam: none 20
        (2, 2, 17, "grads", {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}),  # grads 16
        (2, 2, 14, "full", {"gpipe", "1f1b"}),  # full 11
        (2, 2, 12, "full", {"gpipe", "1f1b"}),
        (2, 2, 11, None, set()),
    ],
)
def test_the_least_sharded_mode_that_fits(
    replicas: int, slots: int, budget: float, mode: str | None, schedules: set[str]
) -> None:
    choice = choose(replicas, slots, budget)
    assert (choice.mode if choice.candidates else None) == mode
    assert {c.schedule for c in choice.candidates} == schedules
    tried = SHARDING_ORDER[: SHARDING_ORDER.index(choice.mode)]
    assert [m for m, _ in choice.ruled_out] == list(tried)  # every less sharded mode was tried
    assert all(need is not None and need > budget * MIB for _, need in choice.ruled_out)


def test_why_names_what_each_less_sharded_mode_needs() -> None:
    assert choose(2, 1, 24).why(24 * MIB) == "none (the least sharded mode) fits"
    assert choose(2, 1, 12).why(12 * MIB) == (
        "none needs 16 MiB a device at its leanest; grads needs 14 MiB a device at its leanest, "
        "over the budget of 12 MiB; full fits"
    )
    assert choose(2, 1, 9).why(9 * MIB).endswith("; full does not fit either")
    one = choose_sharding(lambda s: plan([LAYER] * 8, 2, 4, DEVICE, replicas=s), replicas=1)
    assert one.why(DEVICE.memory_bytes) == "one replica: nothing to shard"
    # the reserve the planner keeps free is counted into the need
    assert "needs 32 MiB a device" in choose(2, 1, 12).why(12 * MIB, reserve=0.5)


DEVICE = DeviceSpec(1e12, memory_bytes=64 * MIB, link_bandwidth=1e9, reserve=0.0)


def test_leanest_is_the_least_peak_of_every_configuration_when_none_fits() -> None:
    full = ReplicaSharding(2, "full")
    nothing = plan([LAYER] * 8, 2, 4, DeviceSpec(1e12, 9 * MIB, 1e9, reserve=0.0), replicas=full)
    assert not nothing and nothing.fitting == 0 and nothing.leanest is not None
    everything = plan([LAYER] * 8, 2, 4, DeviceSpec(1e12, math.inf, 1e9), replicas=full)
    least = min(everything, key=lambda c: max(c.peak_memory_bytes))
    assert nothing.leanest.peak_bytes == max(least.peak_memory_bytes)
    assert (nothing.leanest.schedule, nothing.leanest.chunks) == (least.schedule, least.chunks)
    assert plan([LAYER] * 8, 2, 4, DEVICE, replicas=full).leanest is None  # only when none fits
