"""pipeline.precision=fp16 in the runner: the optimizer steps through the gradient scaler (an
overflow skips the update, no failure; clipping sees unscaled gradients), and the scaler's state
is checkpointed and resumed. In-process on the tiny MLP with two CPU stand-ins (fp16 autocast
runs on CPU)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from giantpipe.config import ExperimentConfig, PipelineConfig
from giantpipe.runner import train
from giantpipe.runner.build import build_experiment
from giantpipe.runner.loop import TrainingLoop
from giantpipe.runner.run_state.restore import restore
from giantpipe.runner.run_state.staging import save_run
from giantpipe.runner.run_state.state import Progress
from giantpipe.runner.seeding import seed_everything
from giantpipe.runner.world import World
from tests.support.runs import tiny


def fp16(**trainer: object) -> ExperimentConfig:
    cfg = tiny(**trainer)
    cfg.pipeline = PipelineConfig(devices="cpu", num_devices=2, chunks=2, precision="fp16")
    return cfg


def test_an_overflow_skips_the_update_and_clipping_sees_unscaled_gradients(tmp_path: Path):
    cfg = fp16(grad_clip=1e6, predict=False)  # clipping on, never binding: the norm is read
    seed_everything(cfg.trainer.seed)
    parts = build_experiment(cfg)
    scaler = parts.grad_scaler
    assert scaler is not None and parts.model is not None
    plain = copy.deepcopy(parts.model)
    stream = parts.bundle.train_batches(cfg.trainer.seed, 0)
    loop = TrainingLoop(cfg, parts, tmp_path, None, Progress(), None, World())

    # 2**40 times any gradient is far beyond fp16's 65504: every rank's verdict is "inf".
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**40})
    before = {n: p.detach().clone() for n, p in parts.names.items()}
    record = loop.optimizer_step(stream)  # no NonFiniteLossError: fp16's normal business
    assert record.grad_norm is None  # an overflowed norm is not logged
    assert all(torch.equal(p, before[n]) for n, p in parts.names.items())
    assert scaler.get_scale() == 2.0**39 and loop.skipped_steps == 1

    scaler.update(2.0**8)
    x, y = next(parts.bundle.train_batches(cfg.trainer.seed, 1))
    record = loop.optimizer_step(parts.bundle.train_batches(cfg.trainer.seed, 1))
    assert loop.skipped_steps == 1 and loop.progress.step == 2
    assert any(not torch.equal(p, before[n]) for n, p in parts.names.items())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = parts.loss_fn(plain(x), y)
    loss.backward()
    norm = torch.stack([p.grad.norm() for p in plain.parameters()]).norm()
    assert record.grad_norm == pytest.approx(float(norm), rel=1e-2)  # not 2**8 times it


def test_the_loss_scale_is_checkpointed_and_resumed(tmp_path: Path):
    cfg = fp16(predict=False)
    seed_everything(cfg.trainer.seed)
    parts = build_experiment(cfg)
    assert parts.grad_scaler is not None
    state = {**parts.grad_scaler.state_dict(), "scale": 2.0**7, "_growth_tracker": 5}
    parts.grad_scaler.load_state_dict(state)
    save_run(parts, Progress(step=1, position=1), tmp_path / "last", World())

    again = build_experiment(cfg)
    assert again.grad_scaler is not None and again.grad_scaler.get_scale() == 2.0**16
    restore(again, tmp_path / "last", World())
    assert again.grad_scaler.state_dict() == state


def test_a_short_fp16_run(tmp_path: Path):
    summary = train(fp16(max_steps=3, eval_every=0, grad_clip=1.0), tmp_path, "")
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert math.isfinite(summary["eval/loss"]) and math.isfinite(summary["train/loss"])
    assert summary["train/loss_scale"] > 0 and summary["train/skipped_steps"] >= 0
