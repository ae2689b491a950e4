"""What each rank runs in the resume tests with R >= 2 replicas (spawned gloo ranks)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch.distributed as dist

from giantpipe.config import PipelineConfig
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from tests.support.runs import tiny


def resume_with_replicas(tmp: Path, stages: int, steps: int, resume_at: int) -> dict[str, Any]:
    """``steps`` steps of an MLP with dropout under the distributed executor (K = ``stages``,
    R = world / K) with an EMA, saving every ``resume_at`` steps; then the run resumed from
    step ``resume_at`` in a new directory. Rank 0 returns both runs' train losses, eval losses
    (the EMA's weights: eval swaps them in)."""
    cfg = tiny(
        max_steps=steps,
        eval_every=steps,
        log_every=1,
        checkpoint_every=resume_at,
        predict=False,
        ema_decay=0.5,
    )
    cfg.model = replace(cfg.model, dropout=0.5, norm="none")
    cfg.pipeline = PipelineConfig(
        devices="cpu", num_devices=stages, chunks=2, executor="distributed", balance="params"
    )
    runs = {"run": cfg}
    resumed = replace(cfg.trainer, resume=str(tmp / "run" / f"step_{resume_at}"))
    runs["resumed"] = replace(cfg, trainer=resumed)
    out: dict[str, Any] = {}
    # The runner leaves the world at the end; the launcher does that here, after the result.
    with mock.patch.object(dist, "destroy_process_group", lambda *_, **__: None):
        for name, run_cfg in runs.items():
            summary = train(run_cfg, tmp / name, "")
            assert summary["status"] == "completed", summary
            dist.barrier()
            if dist.get_rank() == 0:
                lines = read_jsonl(tmp / name / "metrics.jsonl")
                out[name] = {
                    "train": [r["loss"] for r in lines if r["kind"] == "train"],
                    "eval": [r["loss"] for r in lines if r["kind"] == "eval"],  # the EMA's
                }
    return out
