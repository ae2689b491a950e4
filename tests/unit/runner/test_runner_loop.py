"""The training loop in-process on a tiny model: outputs, stops, resumption rules."""

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    PipelineConfig,
)
from giantpipe.data.bundle import DataBundle, EvaluationError
from giantpipe.data.synthetic import classification
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from giantpipe.runner.build import build_experiment
from giantpipe.runner.loop import NonFiniteLossError, TrainingLoop
from giantpipe.runner.run_state.state import Progress
from giantpipe.runner.seeding import seed_everything
from giantpipe.runner.world import World
from models.options import MlpModelConfig
from tests.support.runs import tiny

NAN_FROM = 3  # the training batch from which nan_data returns NaN inputs


def nan_data(features: int, classes: int) -> DataBundle:
    """Generated data whose batches turn to NaN from position NAN_FROM on."""
    clean = classification(features, classes, train_size=256, eval_size=32, batch_size=16)

    def batches(seed: int, position: int):
        for index, (x, y) in enumerate(clean.train_batches(seed, position), start=position):
            yield (x * math.nan if index >= NAN_FROM else x), y

    return replace(clean, train_batches=batches)


def failing_eval_data(features: int, classes: int) -> DataBundle:
    """Generated data whose evaluation breaks on its second batch (a held-out file the model
    cannot take, say), read from ``held_out.tsv``."""
    clean = classification(features, classes, train_size=256, eval_size=32, batch_size=16)

    def eval_batches():
        first, *_ = clean.eval_batches()
        yield first
        raise RuntimeError("The size of tensor a (163) must match the size of tensor b (128)")

    return replace(clean, eval_batches=eval_batches, eval_set="held_out.tsv")


def test_run_writes_metrics_summary_config_and_checkpoint(tmp_path: Path, capsys):
    summary = train(tiny(checkpoint_every=4), tmp_path, "name: tiny\n")
    assert summary["status"] == "completed" and summary["steps"] == 6
    for key in (
        "eval/loss",
        "eval/accuracy",
        "train/loss",
        "train/samples_per_s",
        "pipeline/bubble",
        "pipeline/expected_bubble",
        "pipeline/busy_time_s",
        "pipeline/recompute_share",
        "pipeline/stage_imbalance",
        "pipeline/peak_memory_bytes",
    ):
        assert key in summary, key
    assert summary["pipeline/expected_bubble"] == pytest.approx(1 / 3)  # K=2, M=2
    # the default re-materializes (except_last): M=2 recomputes one micro-batch per stage
    assert 0 < summary["pipeline/recompute_share"] < 1
    assert summary["pipeline/stage_imbalance"] >= 0
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    train_steps = [r["step"] for r in lines if r["kind"] == "train"]
    eval_steps = [r["step"] for r in lines if r["kind"] == "eval"]
    assert (train_steps, eval_steps) == ([2, 4, 6], [3, 6])
    first = next(r for r in lines if r["kind"] == "train")
    for key in (
        "loss",
        "lr",
        "samples_per_s",
        "step_time_s",
        "bubble",
        "expected_bubble",
        "busy_time_s",
        "peak_memory_bytes",
    ):
        assert key in first, key
    assert len(first["busy_time_s"]) == len(first["peak_memory_bytes"]) == 2
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
    assert read_checkpoint(tmp_path / "last")["step"] == 6
    assert read_checkpoint(tmp_path / "step_4")["step"] == 4
    assert (tmp_path / "config.yaml").read_text() == "name: tiny\n"
    assert "eval loss" in capsys.readouterr().out


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path):
    cfg = tiny(eval_every=2, max_steps=8)
    cfg.data = {"_target_": f"{__name__}.nan_data", "features": 8, "classes": 4}
    with pytest.raises(NonFiniteLossError, match=r"step 4: the loss is nan; .*last \(step 2\)"):
        train(cfg, tmp_path, "")
    assert read_checkpoint(tmp_path / "last")["step"] == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 3


def test_an_evaluation_error_names_the_set_and_keeps_the_steps_trained(tmp_path: Path):
    cfg = tiny(eval_every=3, max_steps=6, save_last=False)
    cfg.data = {"_target_": f"{__name__}.failing_eval_data", "features": 8, "classes": 4}
    with pytest.raises(EvaluationError) as caught:
        train(cfg, tmp_path, "")
    assert str(caught.value) == (
        "evaluation on held_out.tsv: RuntimeError: The size of tensor a (163) must match the "
        f"size of tensor b (128) (the 3 steps trained are saved in {tmp_path / 'last'})"
    )
    assert read_checkpoint(tmp_path / "last")["step"] == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 3


def test_fresh_run_refuses_a_directory_holding_a_run(tmp_path: Path):
    train(tiny(max_steps=2), tmp_path, "")
    before = (tmp_path / "last" / "manifest.json").read_bytes()
    with pytest.raises(ConfigError, match="trainer.resume: .* already holds a run"):
        train(tiny(max_steps=2), tmp_path, "")
    assert (tmp_path / "last" / "manifest.json").read_bytes() == before


def test_resume_continues_the_same_losses_even_with_dropout(tmp_path: Path):
    def cfg(**trainer) -> ExperimentConfig:
        c = tiny(log_every=1, **trainer)
        c.model = MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4, dropout=0.2)
        return c

    full = train(cfg(max_steps=6), tmp_path / "full", "")
    train(cfg(max_steps=3), tmp_path / "part", "")
    resumed = train(cfg(max_steps=6, resume=True), tmp_path / "part", "")
    assert resumed["eval/loss"] == full["eval/loss"]
    losses = {
        name: [
            r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"
        ]
        for name in ("full", "part")
    }
    assert losses["part"] == losses["full"]
    assert (tmp_path / "part" / "config.resume_3.yaml").exists()


def test_resume_with_accumulation_sees_the_batches_of_the_uninterrupted_run(tmp_path: Path):
    """trainer.accumulate=2: every optimizer step reads two batches, so a run stopped after 5
    steps resumes at batch 10 (neither re-reading nor skipping any). The resumed steps, which
    cross the epoch boundary (16 batches), equal the uninterrupted run's: losses step by step,
    evaluation and final weights."""

    def cfg(**trainer) -> ExperimentConfig:
        return tiny(log_every=1, eval_every=5, accumulate=2, predict=False, **trainer)

    full = train(cfg(max_steps=10), tmp_path / "full", "")
    train(cfg(max_steps=5), tmp_path / "part", "")
    resumed = train(cfg(max_steps=10, resume=True), tmp_path / "part", "")
    losses = {
        name: [
            r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"
        ]
        for name in ("full", "part")
    }
    assert len(losses["full"]) == 10
    assert losses["part"] == losses["full"]
    assert resumed["eval/loss"] == full["eval/loss"]
    weights = {
        name: read_checkpoint(tmp_path / name / "last")["model"] for name in ("full", "part")
    }
    for key, value in weights["full"].items():
        assert torch.equal(weights["part"][key], value), key


def test_clipping_uses_one_norm_over_every_stage(tmp_path: Path):
    """trainer.grad_clip clips by the global norm over all stages, as torch's clip_grad_norm_
    over the plain model's parameters does: every stage scaled by the same factor, even though
    the stages' own norms differ. One optimizer step of two accumulated batches."""
    # seed 2: initial weights whose stages' gradient norms differ (by half the global norm)
    cfg = tiny(accumulate=2, predict=False, seed=2)
    seed_everything(cfg.trainer.seed)  # as train() does: the same initial weights every time
    parts = build_experiment(cfg)
    assert len(parts.pipe.partitions) == 2
    plain = copy.deepcopy(parts.model)
    stream = parts.bundle.train_batches(cfg.trainer.seed, 0)
    batches = [next(stream) for _ in range(2)]

    total = sum(len(y) for _, y in batches)
    for x, y in batches:  # the same mini-batch, un-pipelined
        (parts.loss_fn(plain(x), y) * (len(y) / total)).backward()
    grads = {name: p.grad.clone() for name, p in plain.named_parameters()}
    name_of = {id(p): name for name, p in parts.names.items()}
    stage_norms = [
        torch.stack([grads[name_of[id(p)]].norm() for p in stage.parameters()]).norm().item()
        for stage in parts.pipe.partitions
    ]
    global_norm = math.hypot(*stage_norms)
    assert abs(stage_norms[0] - stage_norms[1]) > 0.1 * global_norm, stage_norms
    clip = 0.5 * global_norm  # every gradient must shrink by one factor, close to 0.5
    ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)

    cfg.trainer.grad_clip = clip
    loop = TrainingLoop(cfg, parts, tmp_path, None, Progress(), None, World())
    record = loop.optimizer_step(iter(batches))
    assert record.grad_norm == pytest.approx(float(ref_norm), rel=1e-5)
    want = dict(plain.named_parameters())
    for name, p in parts.names.items():
        torch.testing.assert_close(
            p.grad, want[name].grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_accumulation_ema_bf16_and_epochs(tmp_path: Path):
    cfg = tiny(max_steps=None, max_epochs=0.25, accumulate=2, ema_decay=0.9, grad_clip=1.0)
    cfg.pipeline = PipelineConfig(devices="cpu", num_devices=2, chunks=2, precision="bf16")
    summary = train(cfg, tmp_path, "")
    # 256 / 16 = 16 batches per epoch = 8 optimizer steps per epoch; a quarter epoch is 2 steps.
    assert summary["steps"] == 2
    assert math.isfinite(summary["eval/loss"])
    assert read_checkpoint(tmp_path / "last")["ema"] is not None


def test_resume_from_a_path_will_not_overwrite_another_run(tmp_path: Path):
    train(tiny(max_steps=2), tmp_path / "a", "")
    train(tiny(max_steps=2), tmp_path / "b", "")
    before = (tmp_path / "b" / "last" / "manifest.json").read_bytes()
    with pytest.raises(ConfigError, match="holds another run's last/manifest.json"):
        train(tiny(max_steps=4, resume=str(tmp_path / "a" / "last")), tmp_path / "b", "")
    assert (tmp_path / "b" / "last" / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("cut", ["preempted", "run to its end, then extended"])
def test_a_resumed_runs_metrics_are_the_uninterrupted_runs_line_for_line(
    tmp_path: Path, monkeypatch, cut: str
):
    """log_every=5 and a cut after step 7: the window 6-7 is written as a partial line and
    carried by the checkpoint; the resumed run replaces that line by the whole window 6-10, so
    metrics.jsonl's training lines are the uninterrupted run's (their timings aside)."""
    from giantpipe.runner.world import Request, StopSignals

    def cfg(**trainer) -> ExperimentConfig:
        return tiny(log_every=5, eval_every=0, predict=False, **trainer)

    train(cfg(max_steps=12), tmp_path / "full", "")
    if cut == "preempted":  # SIGTERM caught during step 7
        steps = iter(range(1, 100))
        monkeypatch.setattr(
            StopSignals, "take", lambda self: Request("preempted" if next(steps) == 7 else None)
        )
        assert train(cfg(max_steps=12), tmp_path / "part", "")["steps"] == 7
        monkeypatch.undo()
    else:
        train(cfg(max_steps=7), tmp_path / "part", "")
    cut_lines = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    assert [(r["step"], r.get("partial")) for r in cut_lines if r["kind"] == "train"] == [
        (5, None), (7, True),
    ]  # fmt: skip
    train(cfg(max_steps=12, resume=True), tmp_path / "part", "")
    shown = ("kind", "step", "loss", "lr", "partial")
    lines = {
        name: [
            {k: r.get(k) for k in shown}
            for r in read_jsonl(tmp_path / name / "metrics.jsonl")
            if r["kind"] == "train"
        ]
        for name in ("full", "part")
    }
    assert [line["step"] for line in lines["full"]] == [5, 10, 12]
    assert lines["part"] == lines["full"]
