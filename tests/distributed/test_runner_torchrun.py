"""``torchrun --nproc_per_node=2 train.py recipe=mlp_quickstart pipeline.executor=distributed``.

One run of six steps under torchrun (a checkpoint at step 3 and at the end), one resume from
the step-3 shards into a new directory: both end at the local executor's loss, step by step,
and only rank 0 writes a run directory. The model has dropout, whose masks follow from the
step seeds that rank 0 draws, so the resumed steps equal the uninterrupted ones only if the
checkpoint's RNG state is restored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from giantpipe.checkpoint.export import consolidate
from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.cli.checks import to_experiment
from giantpipe.cli.registration import register_configs
from giantpipe.config import ExperimentConfig
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from giantpipe.testing.reference import plain_model
from tests.support.ranks import REPO, finish
from tests.support.runs import TORCHRUN_MLP
from tests.support.train import train_under_torchrun

pytestmark = pytest.mark.distributed

OVERRIDES = TORCHRUN_MLP


def local_config() -> ExperimentConfig:
    register_configs(REPO / "conf")
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return to_experiment(compose("config", OVERRIDES))


def local_run(run_dir: Path) -> list[float]:
    """The same job with the local executor, in this process: the loss of every step."""
    train(local_config(), run_dir, "local\n")
    return losses(run_dir)


def losses(run_dir: Path) -> list[float]:
    return [
        line["loss"] for line in read_jsonl(run_dir / "metrics.jsonl") if line["kind"] == "train"
    ]


def distributed_run(run_dir: Path, *extra: str) -> str:
    proc = train_under_torchrun(run_dir, *OVERRIDES, *extra, timeout=30)
    code, output = finish(proc, timeout=120)
    assert code == 0, output
    return output


def test_torchrun_trains_as_the_local_executor_and_resumes(tmp_path: Path) -> None:
    expected = local_run(tmp_path / "local")
    run = tmp_path / "dist"
    output = distributed_run(run)
    assert losses(run) == pytest.approx(expected, rel=1e-5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["pipeline/world_size"] == 2
    assert summary["train/loss"] == pytest.approx(expected[-1], rel=1e-5)
    assert len(summary["pipeline/busy_time_s"]) == 2  # both stages, gathered on rank 0
    assert summary["pipeline/recompute_share"] > 0  # gathered with them: recompute time
    # Rank 0 alone writes: one run directory, one summary table, one log file.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dist", "local"]
    assert sorted(tmp_path.rglob("summary.json")) == [
        run / "summary.json",
        tmp_path / "local/summary.json",
    ]
    assert output.count("optimizer steps") == 1
    assert sorted(p.name for p in run.iterdir()) == [
        "config.yaml",
        "curves.png",
        "last",
        "metrics.jsonl",
        "step_3",
        "step_6",
        "summary.json",
        # trainer.predict: the forecast's timeline; no measured one, as ranks keep own clocks.
        "timeline_predicted.png",
        "train.log",
    ]
    manifest = json.loads((run / "step_3" / "manifest.json").read_text())
    assert manifest["step"] == 3 and len(manifest["extra"]["state_files"]) == 2

    # The shards merge into one file that the plain model loads, equal to the local run's.
    consolidate(run / "last", tmp_path / "model.pt")
    plain = plain_model(local_config())
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    reference = read_checkpoint(tmp_path / "local" / "last")["model"]
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-6)

    resumed = tmp_path / "resumed"
    distributed_run(resumed, f"trainer.resume={run / 'step_3'}")
    assert losses(resumed) == pytest.approx(expected[3:], rel=1e-5)
