"""What each rank runs in the fp16 loss-scaling tests (tests/distributed/test_gradscale.py).

A DistributedPipe rank holds only its stages; the gradient scaler's inf/NaN verdict must be the
same on every rank, or one rank steps while another skips and the model falls apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.engine import pipeline_grad_scaler
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.distributed.replicas import local_tensor, whole_tensor
from tests.support.shards import shard
from tests.timeouts import scaled

mse = nn.functional.mse_loss
INIT = 3  # layer initialisation seed


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def data(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return shard(x, replica, replicas), shard(y, replica, replicas)


def step(
    pipe: DistributedPipe, number: int, scaler: Any = None, fp16: bool = False
) -> torch.Tensor:
    """One train_step of this rank's share of batch ``number``."""
    x, y = data(number, pipe.replica, pipe.replicas)
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        return pipe.train_step(
            x if pipe.needs_inputs else None,
            y if pipe.needs_targets else None,
            mse,
            grad_scaler=scaler,
        )


def update(pipe: DistributedPipe, scaler: Any, opt: torch.optim.Optimizer) -> bool:
    """scaler.step + update; whether this rank's weights moved."""
    before = [local_tensor(p.detach()).clone() for p in pipe.parameters()]
    scaler.step(opt)
    scaler.update()
    after = [local_tensor(p.detach()) for p in pipe.parameters()]
    return not all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def agreement(tmp: Path, workers: int, bad_rank: int) -> dict[str, Any]:
    """A clean fp32 step (scaled gradients exact), an fp16 step with an inf planted in ONE
    rank's gradients after the step (as if only its stage overflowed), a clean fp16 step.
    Returns each step's scale and whether this rank's weights moved, and its weights."""
    balance = [3, 2] if workers == 2 else [1] * workers
    pipe = DistributedPipe(mlp, balance, chunks=2, seed=INIT, timeout=scaled(20))
    refused = ""
    try:  # torch's own scaler checks one rank's gradients only: refused before any collective
        step(pipe, 0, torch.amp.GradScaler("cpu"))
    except TypeError as err:
        refused = str(err)
    step(pipe, 0)
    unscaled = [local_tensor(p.grad).clone() for p in pipe.parameters()]
    pipe.zero_grad()
    scaler = pipeline_grad_scaler(pipe, init_scale=2.0**10, growth_interval=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    step(pipe, 0, scaler)
    for p, u in zip(pipe.parameters(), unscaled, strict=True):
        assert torch.equal(local_tensor(p.grad), 2.0**10 * u)  # fp32, a power of two: exact
    scales, moved = [], [update(pipe, scaler, opt)]
    scales.append(scaler.get_scale())
    opt.zero_grad()
    step(pipe, 1, scaler, fp16=True)
    if dist.get_rank() == bad_rank:
        # this rank's shard of its first gradient (FSDP2 with replicas)
        local_tensor(next(pipe.parameters()).grad).view(-1)[0] = float("inf")
    moved.append(update(pipe, scaler, opt))
    scales.append(scaler.get_scale())
    opt.zero_grad()
    step(pipe, 2, scaler, fp16=True)
    moved.append(update(pipe, scaler, opt))
    scales.append(scaler.get_scale())
    # whole (every replica's shard, gathered in the same order on every rank of the stage)
    weights = {name: whole_tensor(p.detach()).clone() for name, p in pipe.named_parameters()}
    pipe.release()
    return {"refused": refused, "scales": scales, "moved": moved, "weights": weights}


def runner_fp16(tmp: Path, steps: int) -> dict[str, Any]:
    """``train`` with pipeline.precision=fp16 under the distributed executor, in this rank."""
    from giantpipe.checkpoint.run import read_checkpoint
    from giantpipe.checkpoint.unpickling import safe_load
    from giantpipe.config import PipelineConfig
    from giantpipe.runner import train
    from tests.support.runs import tiny

    cfg = tiny(max_steps=steps, eval_every=0, grad_clip=1.0, predict=False)
    cfg.pipeline = PipelineConfig(
        devices="cpu", num_devices=2, chunks=2, precision="fp16", executor="distributed"
    )
    # The runner leaves the world at the end; the launcher does that here, after the result.
    with mock.patch.object(dist, "destroy_process_group", lambda *_, **__: None):
        summary = train(cfg, tmp / "run", "")
    last = tmp / "run" / "last"
    saved = [safe_load(path)["grad_scaler"] for path in sorted(last.rglob("state-*.pt"))]
    return {"summary": summary, "saved": saved, "step": read_checkpoint(last)["step"]}
