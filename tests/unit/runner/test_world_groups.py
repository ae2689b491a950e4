"""The runner's collectives run on gloo groups (issue 21): its values are Python objects and
CPU tensors, which the world group of an NCCL run does not take. Before ``bind``: a gloo group
of the whole world made once; after: the pipe's ``groups.control``. Recorded, no processes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from giantpipe.runner import world as world_module
from giantpipe.runner.world import TorchrunWorld
from tests.timeouts import scaled


def test_the_runner_talks_on_host_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[Any, str | None]] = []

    def new_group(ranks: Any = None, timeout: Any = None, backend: str | None = None) -> Any:
        made.append((ranks, backend))
        return "<world, gloo>"

    monkeypatch.setattr(world_module, "init_distributed", lambda **kwargs: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "new_group", new_group)
    used: list[Any] = []
    monkeypatch.setattr(
        dist, "broadcast_object_list", lambda box, src, group=None: used.append(group)
    )
    world = TorchrunWorld(timeout=scaled(60.0))
    assert made == [(None, "gloo")]  # the whole world, gloo named, once
    world.from_rank0("set-up")
    pipe = SimpleNamespace(groups=SimpleNamespace(p2p="<p2p>", control="<control>"))
    world.bind(pipe)
    world.from_rank0("a plan")
    assert used == ["<world, gloo>", "<control>"]
