"""``python train.py ... pipeline.plan=auto``: the planner's table in the log, its choice run and
recorded in summary.json, the simulator's forecast beside the measured step. (A budget nothing
fits in: tests/unit/runner/test_runner_plan.py; the CLI prints any ConfigError as one line.)"""

import json
from pathlib import Path

import pytest

from tests.support.runs import QUICK_MLP
from tests.support.train import ok, train

pytestmark = pytest.mark.slow  # python train.py with the planner: measures, simulates, trains


def test_plan_auto_runs_the_planned_settings_and_reports_them(tmp_path: Path):
    run_dir = tmp_path / "run"
    result = ok(
        train(
            *QUICK_MLP,
            "trainer.max_steps=4",
            "pipeline.plan=auto",
            "pipeline.memory_budget_gib=2",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
        )
    )
    log = result.stdout + result.stderr
    assert "pipeline.plan=auto" in log and "| # | schedule | V | M | recompute |" in log
    assert "predicted step" in log and "| measured" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    choice = summary["pipeline/plan_choice"]
    assert summary["pipeline/chunks"] == choice["chunks"] and 64 % choice["chunks"] == 0
    assert summary["pipeline/balance"] == choice["balance"]
    assert choice["memory_budget_bytes"] == 2 * 2**30
    assert summary["pipeline/predicted_step_time_s"] > 0
    for name in ("timeline_predicted.png", "timeline_measured.png"):  # drawn side by side
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plan (pipeline.plan=auto): schedule" in result.stdout  # the summary table
