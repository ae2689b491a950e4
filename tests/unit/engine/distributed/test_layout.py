"""Groups and devices of the distributed executor: the rules the hardware imposes (issue 21).

- Every group names its backend: device groups NCCL on CUDA (gloo on CPU), host groups gloo;
  none inherits the world's, which may take no CPU tensor (an NCCL world).
- On CPU the host groups are the device groups (one set of gloo groups, not two).
- A rank makes its own GPU current (``cuda:LOCAL_RANK``) before the world's group exists, and
  the world serves CPU and CUDA tensors alike (``"cpu:gloo,cuda:nccl"``).
- Boundary payloads travel from the device when it is CUDA, whatever the world's backend.

All of it runs on CPU: a one-process world on a file store, or ``new_group`` recorded.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from giantpipe.engine.distributed import layout as layout_module
from giantpipe.engine.distributed.layout import (
    Layout,
    build_groups,
    comm_device,
    drop_groups,
    end_distributed,
    init_distributed,
    tied_group,
)

ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@pytest.fixture(autouse=True)
def no_cached_groups() -> Iterator[None]:
    """Each test starts and ends without cached groups (a failed one may leave stand-ins)."""
    layout_module._CACHE.clear()
    layout_module._TIED.clear()
    yield
    layout_module._CACHE.clear()
    layout_module._TIED.clear()


@pytest.fixture
def cuda_only_world(tmp_path: Path) -> Iterator[None]:
    """A world of one process whose default group takes CUDA tensors only, as NCCL's would."""
    dist.init_process_group(
        "cuda:gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_groups_of_a_cpu_pipe_are_gloo_and_the_host_groups_are_the_device_groups(
    cuda_only_world: None,
) -> None:
    layout = Layout(world_size=1, rank=0, workers=1, placement=(0,))
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1))  # the world refuses CPU tensors
    groups = build_groups(layout, 30.0, torch.device("cpu"))
    for group in (groups.p2p, groups.control, groups.pipeline, groups.host_pipeline):
        assert dist.get_backend(group) == "gloo"
        value = torch.ones(1)
        dist.all_reduce(value, group=group)  # a CPU tensor goes through
        assert value.item() == 1.0
    assert groups.control is groups.p2p
    assert groups.host_pipeline is groups.pipeline
    assert groups.replica is None and groups.host_replica is None  # R = 1
    assert build_groups(layout, 30.0, "cpu") == groups  # cached: no second set of groups
    tied = tied_group(layout, [0], 30.0, torch.device("cpu"))
    assert dist.get_backend(tied) == "gloo"
    dist.broadcast(torch.ones(2), src=0, group=tied)
    drop_groups(groups)


class _Recorder:
    """Stands for ``dist.new_group``: records (ranks, backend) and returns a fresh object."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], str | None, Any]] = []

    def __call__(self, ranks: list[int], timeout: Any = None, backend: str | None = None) -> Any:
        group = object()
        self.calls.append((tuple(ranks), backend, group))
        return group

    def backend_of(self, group: Any) -> str | None:
        return next(b for _, b, g in self.calls if g is group)

    def ranks_of(self, group: Any) -> tuple[int, ...]:
        return next(r for r, _, g in self.calls if g is group)


def test_groups_of_a_cuda_pipe_are_nccl_for_tensors_and_gloo_for_host_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU needed: only the construction is checked, with new_group recorded.
    recorder = _Recorder()
    monkeypatch.setattr(dist, "new_group", recorder)
    world = object()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: world)
    monkeypatch.delenv(ERROR_HANDLING, raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    layout = Layout(world_size=4, rank=3, workers=2, placement=(0, 1))  # replica 1, worker 1
    groups = build_groups(layout, 30.0, torch.device("cuda", 1))
    assert all(backend in ("nccl", "gloo") for _, backend, _ in recorder.calls), "inherited"
    device = {"p2p": (0, 1, 2, 3), "pipeline": (2, 3), "replica": (1, 3)}
    host = {"control": (0, 1, 2, 3), "host_pipeline": (2, 3), "host_replica": (1, 3)}
    for name, ranks in device.items():
        assert recorder.backend_of(getattr(groups, name)) == "nccl", name
        assert recorder.ranks_of(getattr(groups, name)) == ranks, name
    for name, ranks in host.items():
        assert recorder.backend_of(getattr(groups, name)) == "gloo", name
        assert recorder.ranks_of(getattr(groups, name)) == ranks, name
    assert len(groups.unique()) == 6
    tied = tied_group(layout, [0, 1], 30.0, torch.device("cuda", 1))
    assert recorder.backend_of(tied) == "nccl" and recorder.ranks_of(tied) == (2, 3)
    # NCCL reads it when a group is made: a hung collective aborts its communicator at the
    # group's timeout (the failure then takes the engine's path) instead of ending the process.
    assert layout_module.os.environ[ERROR_HANDLING] == "2"


def test_drop_groups_destroys_each_group_once(monkeypatch: pytest.MonkeyPatch) -> None:
    shared, replica = object(), object()
    groups = layout_module.Groups(shared, shared, object(), replica, object(), replica)
    destroyed: list[int] = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda g: destroyed.append(id(g)))
    drop_groups(groups)
    assert len(destroyed) == len(set(destroyed)) == 4


def test_a_user_set_error_handling_mode_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "3")  # the old spelling counts too
    monkeypatch.delenv(ERROR_HANDLING, raising=False)
    layout_module.default_nccl_error_handling()
    assert ERROR_HANDLING not in layout_module.os.environ


def test_init_distributed_makes_this_ranks_gpu_current_before_the_world_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend))
    )
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv(ERROR_HANDLING, raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    init_distributed()
    assert calls == [("set_device", torch.device("cuda", 3)), ("init", "cpu:gloo,cuda:nccl")]
    assert layout_module.os.environ[ERROR_HANDLING] == "2"


def test_init_distributed_without_cuda_is_gloo_and_selects_no_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend))
    )
    init_distributed()
    assert calls == [("init", "gloo")]


def test_a_bare_cuda_device_is_this_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert layout_module.resolve_device("cuda") == torch.device("cuda", 2)
    assert layout_module.resolve_device("cuda:0") == torch.device("cuda", 0)  # as asked
    assert layout_module.resolve_device("cpu") == torch.device("cpu")


def test_a_rank_without_its_own_gpu_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    with pytest.raises(RuntimeError, match="cuda:2 does not exist.*2 GPU"):
        layout_module.bind_device(torch.device("cuda", 2))


def test_boundary_payloads_leave_from_a_cuda_device_whatever_the_world(
    tmp_path: Path,
) -> None:
    # A world serving both kinds, as init_distributed makes on CUDA: its backend string is not
    # "nccl", and CUDA activations must still go by the device groups.
    dist.init_process_group(
        "cpu:gloo,cuda:gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert comm_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
        assert comm_device(torch.device("cpu")) == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_ending_the_world_frees_every_group_before_the_interpreters_shutdown(
    tmp_path: Path,
) -> None:
    # A group the pipes' caches kept alive was freed during the shutdown, where a gloo thread
    # freeing a request's tensor aborted a rank whose run had succeeded.
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    layout = Layout(world_size=1, rank=0, workers=1, placement=(0,))
    groups = build_groups(layout, 30.0, torch.device("cpu"))
    made = [*groups.unique(), tied_group(layout, [0], 30.0, "cpu"), dist.group.WORLD]
    alive = [weakref.ref(group) for group in made]
    del groups, made
    end_distributed()
    assert not dist.is_initialized()
    assert [ref for ref in alive if ref() is not None] == []
