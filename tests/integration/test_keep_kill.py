"""A kill -9 during pruning loses no kept checkpoint: at every point of a removal (recorded,
set aside, half erased) the kept step_N/ and last/ are whole and load, and the resumed run
finishes the removal and keeps what the uninterrupted run keeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from giantpipe.runner import train
from giantpipe.runner.ledger import LEDGER
from tests.integration.prune_killer import POINTS, config
from tests.support.runs import kept_steps, whole

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a run in its own process, killed, then resumed


def killed_while_pruning(run_dir: Path, point: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    command = [sys.executable, "-m", "tests.integration.prune_killer", str(run_dir), point]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_while_pruning_loses_no_kept_checkpoint(tmp_path: Path, point: str):
    killed_while_pruning(tmp_path, point)
    # Killed while removing step_2 after step_6 committed: step_4, step_6 and last/ are whole.
    assert [whole(tmp_path / f"step_{s}") for s in (4, 6)] == [4, 6]
    assert whole(tmp_path / "last") == 6
    assert json.loads((tmp_path / LEDGER).read_text())["removing"] == ["step_2"]
    if point == "recorded":
        assert whole(tmp_path / "step_2") == 2  # never set aside: still a whole checkpoint
    else:
        assert not (tmp_path / "step_2").exists() and (tmp_path / "step_2.removing").is_dir()

    summary = train(config(resume=True), tmp_path, "")
    assert summary["status"] == "completed" and summary["steps"] == 8
    assert kept_steps(tmp_path) == [6, 8]  # as the uninterrupted run keeps
    assert [whole(tmp_path / f"step_{s}") for s in (6, 8)] == [6, 8]
    assert whole(tmp_path / "last") == 8
    assert not list(tmp_path.glob("*.removing"))
    assert json.loads((tmp_path / LEDGER).read_text())["removing"] == []
