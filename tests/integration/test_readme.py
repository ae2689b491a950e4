"""The README's quick start is what a new user runs: keep its two commands true."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the quick start has no bash block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_has_two_commands_and_ci_runs_the_second() -> None:
    main_job, tests = quick_start_commands()
    assert main_job.endswith("python train.py")
    assert tests.endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), ".ci/run must run the README's test command verbatim"


@pytest.mark.slow
def test_main_job_command_runs_as_written(tmp_path: Path) -> None:
    """The first command, as typed: install (already satisfied here, so quick) + the default job."""
    main_job, _ = quick_start_commands()
    install, job = main_job.split(" && ")
    pip = shlex.split(install)
    assert pip[:2] == ["pip", "install"]
    subprocess.run(
        [sys.executable, "-m", *pip, "--no-deps", "-q"], cwd=ROOT, check=True, timeout=600
    )
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, *shlex.split(job)[1:], f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,  # minutes on 2 busy cores
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads((run_dir / "summary.json").read_text())
    assert figures["name"] == "amoebanet_quickstart"
    assert figures["eval/accuracy"] > 0.8  # 10 classes: chance is 0.1, the README says ~0.95
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] > 1.2 and figures["eval/loss"] < 0.5  # the loss clearly falls
    assert "eval accuracy" in done.stdout  # the summary table is printed
    assert "eval top-5 accuracy" in done.stdout


def test_the_quick_start_tells_a_cpu_user_the_cpu_build_and_the_smaller_extras() -> None:
    """Without a GPU the default torch wheels bring about 6 GB of CUDA libraries: the quick
    start names torch's CPU index, and every extra of pyproject.toml besides dev."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "`pip install torch --index-url https://download.pytorch.org/whl/cpu`" in section
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"]) - {"dev"}
    assert extras and all(f"`{extra}`" in section for extra in extras), extras
    assert "`pip install -e .`" in section
