"""The planner and the memory model know how each stage is spread over its replicas: a rank's
bytes of a layer's state at the step's peak (measured: results/replicas/memory.md), and a model
too big for K devices that fits K x R with full sharding."""

from __future__ import annotations

import pytest

from giantpipe.perf.costs import LayerCost
from giantpipe.perf.planner import DeviceSpec, plan
from giantpipe.perf.replica_state import ReplicaSharding


@pytest.mark.parametrize(
    ("replicas", "mode", "split", "peak", "gathered", "rest"),
    [
        (1, "full", False, 4000, 0, 4000),  # one replica: nothing to spread
        (2, "none", False, 5000, 0, 4000),  # replicate's unsharded parameters beside its own
        (2, "full", False, 2000, 900, 2000),  # shards; one unit's params, grads, reduce input
        (4, "full", False, 1000, 900, 1000),
        (4, "full", True, 2000 + 1000, 0, 1000),  # zero bubble keeps the units gathered
        (4, "grads", False, 2000 + 1000, 0, 1000),
    ],
)
def test_a_layers_bytes_per_rank(
    replicas: int, mode: str, split: bool, peak: float, gathered: int, rest: float
) -> None:
    sharding = ReplicaSharding(replicas, mode, split)
    assert sharding.layer_bytes(1000, slots=2) == peak  # Adam: 2 slots
    assert sharding.gathered_bytes(300) == gathered
    assert sharding.rest_bytes(1000, slots=2) == rest


def test_a_bad_sharding_is_refused() -> None:
    with pytest.raises(ValueError, match="replica_sharding"):
        ReplicaSharding(2, "zero3")
    with pytest.raises(ValueError, match="replicas"):
        ReplicaSharding(0)


def _layers(n: int) -> list[LayerCost]:
    return [LayerCost(1e6, 10**6, 4 * 10**6, 1024, 1024, 1024, 1024) for _ in range(n)]


def test_full_sharding_fits_what_k_devices_alone_do_not() -> None:
    # 8 layers of 4 MB parameters, Adam (2 slots): a stage of 4 layers holds 64 MB unsharded
    device = DeviceSpec(peak_flops=1e12, memory_bytes=40 * 2**20, link_bandwidth=1e9, reserve=0.0)
    kwargs = dict(optimizer_slots=2, schedules=["1f1b"], recompute=["always"], chunks=[4])
    assert not plan(_layers(8), 2, 8, device, **kwargs)
    full = plan(_layers(8), 2, 8, device, replicas=ReplicaSharding(4, "full"), **kwargs)
    assert full and max(full[0].peak_memory_bytes) <= 40 * 2**20  # 16 + 3 x 4 MB, activations
    # grads keeps the stage's parameters gathered through the step (48 MB): it does not fit
    assert not plan(_layers(8), 2, 8, device, replicas=ReplicaSharding(4, "grads"), **kwargs)


def test_table_1s_stage_peaks_with_replicas() -> None:
    import torch

    from giantpipe.perf.memory import TensorSpec
    from giantpipe.perf.sizing import stage_peaks
    from giantpipe.perf.stage_memory import LayerMemory

    spec = TensorSpec((1,), torch.float32)
    # 1000 bytes of weights, RMSProp (1 slot), 50 bytes of buffers; input 10, saved 20
    layer = LayerMemory(250, 3 * 1000 + 50, 10, 20, 5, spec, weights=1000, slots=1)
    alone = stage_peaks([layer] * 4, [2, 2], 4, "always")
    spread = stage_peaks([layer] * 4, [2, 2], 4, "always", ReplicaSharding(4, "full"))
    # per layer 3000 -> 3000 / 4; one unit (1000) gathered, its gradients and a reduce's input
    assert [a - s for a, s in zip(alone, spread, strict=True)] == [2 * (3000 - 750) - 3000] * 2
