"""What each rank runs in the checkpoint tests that drive the runner (spawned gloo ranks)."""

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


def async_save_then_resume(tmp: Path, steps: int) -> dict[str, Any]:
    """``steps`` steps under the distributed executor with trainer.async_save (a checkpoint
    every two steps), then a synchronous resume of its step_2 into a new directory."""
    cfg = tiny(max_steps=steps, eval_every=0, log_every=1, checkpoint_every=2, predict=False)
    cfg.pipeline = PipelineConfig(devices="cpu", num_devices=2, chunks=2, executor="distributed")
    saving = replace(cfg, trainer=replace(cfg.trainer, async_save=True))
    # The runner leaves the world at the end; the launcher does that here, after the result.
    with mock.patch.object(dist, "destroy_process_group", lambda *_, **__: None):
        summary = train(saving, tmp / "run", "")
        resumed = replace(cfg.trainer, resume=str(tmp / "run" / "step_2"))
        again = train(replace(cfg, trainer=resumed), tmp / "resumed", "")
    losses = {}
    if dist.get_rank() == 0:
        for run in ("run", "resumed"):
            lines = read_jsonl(tmp / run / "metrics.jsonl")
            losses[run] = [r["loss"] for r in lines if r["kind"] == "train"]
    return {"summary": summary, "again": again, "losses": losses}
