"""``python train.py ... trainer.init_from=PATH`` given a file it cannot start from: one line
naming the file (and the stage it lacks), exit status 2, and nothing of a run written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.train import train

TINY = [
    "recipe=mlp_quickstart",
    "data.train_size=64",
    "data.eval_size=16",
    "model.depth=3",
    "model.hidden=16",
    "pipeline.balance=[2,2]",
    "trainer.max_steps=1",
    "logger.progress=none",
]

pytestmark = pytest.mark.slow  # train.py in a subprocess


def train_tiny(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return train(*TINY, f"hydra.run.dir={run_dir}", *args, cwd=run_dir.parent, timeout=300)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The tiny run's own weights, as a finished run leaves them."""
    run_dir = tmp_path_factory.mktemp("init") / "run"
    done = train_tiny(run_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    from giantpipe.checkpoint.run import read_checkpoint

    return read_checkpoint(run_dir / "last")["model"]


def refused(run_dir: Path, path: Path) -> str:
    """The one line a refused init_from prints; nothing of a run is left in ``run_dir``."""
    result = train_tiny(run_dir, f"trainer.init_from={path}")
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    left = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert not {"config.yaml", "metrics.jsonl", "summary.json", "last"} & set(left), left
    return lines[0]


def test_a_damaged_safetensors_header_is_one_line_naming_the_file(weights, tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(weights, path)
    raw = bytearray(path.read_bytes())
    raw[8:16] = b"\xff" * 8  # the header's JSON, damaged
    path.write_bytes(bytes(raw))
    line = refused(tmp_path / "run", path)
    assert line.startswith(
        f"error: trainer.init_from: {path} is damaged (not a readable safetensors header"
    )


def test_a_file_lacking_a_stages_tensors_is_one_line_naming_the_stage(weights, tmp_path) -> None:
    path = tmp_path / "first_layers.pt"
    torch.save({k: v for k, v in weights.items() if k.startswith("0.")}, path)
    line = refused(tmp_path / "run", path)
    assert line.startswith(f"error: trainer.init_from: {path} has no tensor of stage 1 (")
