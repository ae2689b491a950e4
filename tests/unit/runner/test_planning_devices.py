"""The hardware rule of planning under torchrun, as a CPU test: a rank touches only its own
device (a GPU in exclusive-process mode refuses a second process's context). Each rank measures
its memory and its link to the next pipeline rank, the ranks agree, and rank 0 alone measures the
layers, on its own device, one at a time.

Other ranks' devices are named ``cuda:98`` and ``cuda:99`` here, devices no machine has: any
touch of them fails the test, on this CPU machine and on a GPU one alike. The world is one rank
of a torchrun world, its peers' answers given (no processes: the collective parts run in
tests/distributed/test_runner_features.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

import giantpipe.runner.planning as planning
from giantpipe.config import ExperimentConfig, LoggerConfig, PipelineConfig, TrainerConfig
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.engine.meta import build_on_meta, seeded_init
from giantpipe.engine.spec import PipelineSpec
from giantpipe.perf.costs import LayerTimer
from giantpipe.perf.links import neighbour_bandwidth
from giantpipe.runner.planning import Hardware, agree_hardware, plan_pipeline
from giantpipe.runner.world import World
from models.options import MlpModelConfig

T = TypeVar("T")
GIB = 2**30


class OneRank(World):
    """Rank ``rank`` of a torchrun world; ``peers``: what the other ranks gather, by rank;
    ``decided``: what rank 0 hands to the others."""

    def __init__(self, rank: int, peers: dict[int, Any], decided: Any = None) -> None:
        self.rank, self.size = rank, len(peers) + 1
        self.peers, self.decided = peers, decided

    def agree(self, body: Callable[[], T]) -> T:
        return body()

    def gather(self, value: T) -> list[T]:
        return [value if r == self.rank else self.peers[r] for r in range(self.size)]

    def from_rank0(self, value: T) -> T:
        return value if self.rank == 0 else self.decided


def config(budget: float | None = None) -> ExperimentConfig:
    pipeline = PipelineConfig(devices="cpu", plan="auto", memory_budget_gib=budget)
    return ExperimentConfig(
        name="devices",
        model=MlpModelConfig(),
        data=SyntheticDataConfig(),
        pipeline=pipeline,
        trainer=TrainerConfig(),
        logger=LoggerConfig(progress="none"),
    )


def meta_mlp() -> nn.Sequential:
    return build_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))


@pytest.fixture
def links(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, str]]:
    """The links each rank times: (rank, pipeline ranks, device), each 1 GB/s."""
    seen: list[tuple[int, int, str]] = []

    def timed(rank: int, workers: int, device: str) -> float | None:
        seen.append((rank, workers, device))
        return 1e9 if rank < workers - 1 else None

    monkeypatch.setattr(planning, "neighbour_bandwidth", timed)
    return seen


def test_rank0_measures_and_plans_on_its_own_device_only(links: list) -> None:
    made: list[int] = []
    init = seeded_init(0)
    world = OneRank(0, peers={1: (2 * GIB, None)})
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    spec, choice = plan_pipeline(
        config(),
        meta_mlp(),
        ["cpu", "cuda:99"],  # rank 1's device: never touched from rank 0
        x,
        y,
        nn.functional.cross_entropy,
        world=world,
        own="cpu",
        init=lambda i, layer: (made.append(i), init(i, layer)),
    )
    assert links == [(0, 2, "cpu")]
    assert choice["memory_budget_bytes"] == 2 * GIB  # the least of the ranks' budgets
    assert spec.devices == ("cpu", "cuda:99") and sum(spec.balance) == 3
    assert made.count(0) == made.count(2) == 1  # each layer made real once


def test_other_ranks_measure_only_their_own_memory_and_link(links: list) -> None:
    planned = (PipelineSpec((1, 2), chunks=2, devices=("cuda:98", "cpu")), {"chunks": 2})
    world = OneRank(1, peers={0: (GIB, 1e9)}, decided=planned)

    def never(i: int, layer: nn.Module) -> None:
        raise AssertionError("only rank 0 measures the layers")

    got = plan_pipeline(
        config(budget=4.0),
        meta_mlp(),
        ["cuda:98", "cpu"],
        torch.randn(8, 8),
        torch.randint(0, 4, (8,)),
        nn.functional.cross_entropy,
        world=world,
        own="cpu",
        init=never,
    )
    assert got == planned
    assert links == [(1, 2, "cpu")]


def test_the_ranks_agree_on_the_least_memory_and_the_slowest_link(links: list) -> None:
    peers = {1: (3 * GIB, 4e8), 2: (GIB, None), 3: (5 * GIB, None)}  # rank 2: the last; 3: R=2
    hardware = agree_hardware(
        PipelineConfig(memory_budget_gib=2.0), ["cpu"] * 3, "cpu", OneRank(0, peers)
    )
    assert hardware == Hardware(memory_bytes=GIB, link_bandwidth=4e8)
    alone = agree_hardware(PipelineConfig(memory_budget_gib=2.0), ["cpu"] * 2, "cpu", World())
    assert alone == Hardware(memory_bytes=2 * GIB, link_bandwidth=float("inf"))  # one process
    assert links == [(0, 3, "cpu")]  # the local executor times its own devices' copies


def test_each_rank_times_only_its_links_one_after_the_other(monkeypatch: pytest.MonkeyPatch):
    seen: list[tuple[int, str, str, int]] = []

    def record(kind: str) -> Callable[..., None]:
        def op(tensor: torch.Tensor, peer: int, group: Any = None) -> None:
            seen.append((rank, kind, str(tensor.device), peer))

        return op

    monkeypatch.setattr(dist, "send", record("send"))
    monkeypatch.setattr(dist, "recv", record("recv"))
    found = {}
    for rank in range(6):  # K=3 pipeline ranks x R=2 replicas
        found[rank] = neighbour_bandwidth(rank, 3, "meta", nbytes=64)  # meta: "not the host"
    assert {r: b is not None for r, b in found.items()} == {
        0: True, 1: True, 2: False, 3: False, 4: False, 5: False
    }  # fmt: skip
    # rank 1 echoes rank 0's probe, then probes its own link to rank 2; every frame on its device
    assert [(kind, peer) for r, kind, _, peer in seen if r == 1][:2] == [("recv", 0), ("send", 0)]
    assert [(kind, peer) for r, kind, _, peer in seen if r == 1][-2:] == [("send", 2), ("recv", 2)]
    assert {device for *_, device, _ in seen} == {"meta"}
    assert not [s for s in seen if s[0] >= 3]  # the other replica's ranks time nothing


def test_layers_are_timed_at_a_replicas_micro_batches(
    links: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[list[int]] = []
    calibrate = LayerTimer.calibrate

    def recorded(timer: LayerTimer, wanted: list[int]) -> None:
        sizes.append(sorted(wanted))
        calibrate(timer, wanted)

    monkeypatch.setattr(LayerTimer, "calibrate", recorded)
    peers = {r: (GIB, None) for r in (1, 2, 3)}  # K=2 x R=2
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    _, choice = plan_pipeline(
        config(budget=1.0), meta_mlp(), ["cpu", "cpu"], x, y, nn.functional.cross_entropy,
        replicas=2, world=OneRank(0, peers), own="cpu", init=seeded_init(0),
    )  # fmt: skip
    assert sizes == [[1, 8]]  # a replica's 8 samples in 8 micro-batches, or in 1
    assert (choice["replicas"], choice["replica_sharding"]) == (2, "none")
