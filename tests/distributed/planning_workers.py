"""What each rank runs in tests/distributed/test_planning.py (K=2 pipeline ranks x R=2)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from giantpipe.config import PipelineConfig
from giantpipe.engine.meta import build_on_meta, seeded_init
from giantpipe.runner import build as runner_build
from giantpipe.runner import train
from giantpipe.runner.planning import plan_pipeline
from giantpipe.runner.world import TorchrunWorld
from tests.support.runs import tiny


def plan_by_share(tmp: Path) -> dict[str, Any]:
    """Every rank plans a model built on meta (each layer made real by its init on rank 0 only,
    each rank timing its own link); then the runner under plan=auto, whose pipe must take the
    replica sharding the planner picked over the config's."""
    made: list[int] = []
    init = seeded_init(0)

    def counted(index: int, layer: nn.Module) -> None:
        made.append(index)
        init(index, layer)

    world = TorchrunWorld(timeout=60)
    model = build_on_meta(lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]))
    cfg = tiny(predict=False)
    pipeline = PipelineConfig(
        devices="cpu",
        num_devices=2,
        executor="distributed",
        plan="auto",
        memory_budget_gib=1.0,
        replica_sharding="full",
    )
    cfg = replace(cfg, pipeline=pipeline, trainer=replace(cfg.trainer, max_steps=2, eval_every=0))
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    loss = nn.functional.mse_loss
    devices = ["cpu", "cpu"]
    spec, choice = plan_pipeline(
        cfg, model, devices, x, y, loss, replicas=2, world=world, own="cpu", init=counted
    )
    built: list[Any] = []
    real_build = runner_build.build_experiment

    def keep(*args: Any, **kwargs: Any) -> Any:
        built.append(real_build(*args, **kwargs))
        return built[-1]

    with (  # the runner leaves the world at the end; the launcher does that here
        mock.patch.object(dist, "destroy_process_group", lambda *_, **__: None),
        mock.patch("giantpipe.runner.run.build_experiment", keep),
    ):
        summary = train(cfg, tmp / "run", "")
    return {
        "spec": spec,
        "choice": choice,
        "made": len(made),
        "meta": all(p.device.type == "meta" for p in model.parameters()),
        "status": summary["status"],
        "run_choice": summary.get("pipeline/plan_choice"),
        "pipe_sharding": built[-1].pipe.replica_sharding,
    }
