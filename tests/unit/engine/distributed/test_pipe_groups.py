"""Which group each collective of DistributedPipe goes to (issue 21).

Host numbers (the loss, its normaliser, the step's statistics rows) are CPU tensors and go to
host (gloo) groups; the checkpoint's objects to ``groups.control``; gradients and the norm to
the device groups. On CPU the two kinds are the same groups, so a multi-process test cannot
tell a misrouted value from a right one; here every group is a distinct stand-in and the
collectives are recorded. (On CUDA a CPU tensor on an NCCL group fails outright.)
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from giantpipe.engine.distributed import pipe as pipe_module
from giantpipe.engine.distributed.layout import Groups, Layout
from giantpipe.engine.distributed.pipe import DistributedPipe
from tests.timeouts import scaled

NAMES = ("p2p", "control", "pipeline", "replica", "host_pipeline", "host_replica")


def _fake_pipe() -> Any:
    groups = Groups(*[f"<{name}>" for name in NAMES])
    layout = Layout(world_size=4, rank=3, workers=2, placement=(0, 1))  # last stage, replica 1
    return SimpleNamespace(
        groups=groups,
        layout=layout,
        device=torch.device("cpu"),
        timeout=scaled(30.0),
        board=None,
        chunks=2,
        virtual_stages=1,
        placement=[0, 1],
        _guarded=lambda body: body(),
        _box=None,  # the step's mailbox: its requests checked after the step (none here)
    )


def test_host_numbers_go_to_host_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, Any, str]] = []

    def reduce_sum(value: float, group: Any, timeout: float, board: Any, what: str) -> float:
        seen.append(("sum", group, what))
        return value

    def gather_rows(row: torch.Tensor, group: Any, ranks: list[int], *rest: Any) -> torch.Tensor:
        seen.append(("gather", group, str(row.device)))
        return torch.stack([row, row])

    monkeypatch.setattr(pipe_module, "all_reduce_sum", reduce_sum)
    monkeypatch.setattr(pipe_module, "all_gather_rows", gather_rows)
    fake = _fake_pipe()
    DistributedPipe._reduce_normalizer(fake, 8.0)
    run = SimpleNamespace(
        worker_peaks=[0, 0],
        busy=[0.1, 0.2],
        recomputed=[0.0, 0.0],
        span=0.3,
        cuda=False,
        timings=[],
    )
    DistributedPipe._finish(fake, run, 0.0, torch.tensor(1.5))
    assert seen == [
        ("sum", "<host_replica>", "the loss normaliser"),
        ("sum", "<host_replica>", "the loss"),
        ("gather", "<host_pipeline>", "cpu"),
    ]


def test_checkpoint_objects_go_to_the_control_group(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(
        pipe_module,
        "save",
        lambda pipe, directory, step, extra, group=None: seen.append(group),
    )
    DistributedPipe.save_checkpoint(_fake_pipe(), "ckpt", step=3)
    assert seen == ["<control>"]


def test_clipping_goes_to_a_device_group_of_every_rank_holding_a_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the pipeline's ranks; with replicas, each holding a shard of its stage, the world's
    seen: list[tuple[Any, Any]] = []

    def clip(pipe: Any, max_norm: float, **kwargs: Any) -> torch.Tensor:
        seen.append((kwargs.get("group", pipe.groups.pipeline), kwargs.get("device")))
        return torch.zeros(())

    monkeypatch.setattr(pipe_module, "clip_grad_norm_", clip)
    for world in (4, 2):
        pipe = _fake_pipe()
        pipe.layout = Layout(world_size=world, rank=1, workers=2, placement=(0, 1))
        pipe.norm_group = lambda pipe=pipe: DistributedPipe.norm_group(pipe)
        DistributedPipe.clip_grad_norm_(pipe, 1.0)
    assert seen == [("<p2p>", torch.device("cpu")), ("<pipeline>", torch.device("cpu"))]
