"""What each rank runs in tests/distributed/test_profiling.py: one step of a DistributedPipe
under a plain ``torch.profiler.profile()``; the ops the profiler saw, by the action's range."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from giantpipe.engine.distributed.pipe import DistributedPipe
from tests.timeouts import scaled


def linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))


def profiled_step(tmp: Path, schedule: str) -> dict[str, Any]:
    """This rank's stage and the ``aten::addmm`` of its profiled step, by action range."""
    pipe = DistributedPipe(linears, [2, 2], chunks=2, schedule=schedule, timeout=scaled(20))
    x, y = torch.randn(4, 8), torch.arange(4) % 4
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pipe.train_step(x, y, nn.functional.cross_entropy)
    found: dict[str, int] = {}
    for event in prof.events():
        if event.name != "aten::addmm":
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("giantpipe "):
            parent = parent.cpu_parent
        action = parent.name if parent is not None else "outside any action"
        found[action] = found.get(action, 0) + 1
    names = sorted({e.name for e in prof.events() if e.name.startswith("giantpipe ")})
    return {"stage": pipe.layout.worker, "addmm": found, "ranges": names}
