"""Checkpoints by un-partitioned names: resume under another K, consolidate for the plain model,
save in the background under the distributed executor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.earlier import SHARDS_V1
from giantpipe.checkpoint.errors import MissingTensors
from giantpipe.checkpoint.load import load
from giantpipe.consolidate import main as consolidate_main
from tests.distributed.workers import plain_model
from tests.support.ranks import REPO, spawn

pytestmark = pytest.mark.distributed


def test_resume_with_another_k_then_consolidate(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved = spawn(
        "tests.distributed.workers:train_and_save",
        world=2,
        tmp=tmp_path / "k2",
        workers=2,
        ckpt=str(ckpt),
    )
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["workers"] == 2 and manifest["step"] == 2
    assert [s["rank"] for s in manifest["shards"]] == [0, 1]
    union = {k: v for r in saved for k, v in r["state"].items()}
    assert sorted(n for s in manifest["shards"] for n in s["names"]) == sorted(union)

    resumed = spawn(
        "tests.distributed.workers:resume_and_step",
        world=3,
        tmp=tmp_path / "k3",
        workers=3,
        ckpt=str(ckpt),
    )
    loaded = {k: v for r in resumed for k, v in r["loaded"].items()}
    assert loaded.keys() == union.keys()  # three ranks now hold what two held
    for name, value in union.items():
        assert torch.equal(loaded[name], value), name
    assert all(r["checked"] > 0 for r in resumed)

    out = tmp_path / "model.pt"
    cli = subprocess.run(
        [sys.executable, "-m", "giantpipe.consolidate", str(ckpt), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": f"{REPO / 'src'}", "PATH": "/usr/bin:/bin"},
    )
    assert cli.returncode == 0, cli.stderr
    assert "from 2 shards (step 2)" in cli.stdout
    model = plain_model(2)
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every name, no extra
    for name, value in model.state_dict().items():
        assert torch.equal(value, union[name]), name


def test_consolidate_reports_a_missing_manifest(tmp_path: Path, capsys) -> None:
    assert consolidate_main([str(tmp_path), str(tmp_path / "x.pt")]) == 2
    assert "manifest.json" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_load_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": SHARDS_V1, "step": 0, "shards": []})
    )
    with pytest.raises(MissingTensors, match=r"0\.weight"):
        load(tmp_path, ["0.weight"])


def test_async_saves_under_the_distributed_executor_resume_exactly(tmp_path: Path) -> None:
    """trainer.async_save with two ranks: the background writes run their collectives on a
    group of their own beside the steps', commit both ranks' files, and resume exactly."""
    results = spawn(
        "tests.distributed.checkpoint_workers:async_save_then_resume",
        world=2,
        tmp=tmp_path,
        steps=4,
    )
    for result in results:
        assert result["summary"]["status"] == result["again"]["status"] == "completed"
    losses = results[0]["losses"]
    assert len(losses["run"]) == 4 and losses["resumed"] == losses["run"][2:]
    for name in ("step_2", "step_4", "last"):
        manifest = json.loads((tmp_path / "run" / name / "manifest.json").read_text())
        assert [s["rank"] for s in manifest["shards"]] == [0, 1], name
        assert len(manifest["extra"]["state_files"]) == 2, name
        assert manifest["step"] == (2 if name == "step_2" else 4), name
