"""The suite's timeouts (tests/timeouts.py): one knob, GIANTPIPE_TEST_TIMEOUT_SCALE, lengthens
them all; a test that runs out of time names the timeout and the knob, whatever timed out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.timeouts import KNOB, run, scaled

REPO = Path(__file__).resolve().parents[2]


def test_the_knob_scales_every_timeout(monkeypatch) -> None:
    monkeypatch.delenv(KNOB, raising=False)
    assert scaled(20) == 20
    monkeypatch.setenv(KNOB, "3")
    assert scaled(20) == 60
    for bad in ("0", "-1", "fast"):
        monkeypatch.setenv(KNOB, bad)
        with pytest.raises(ValueError, match=f"{KNOB}='{bad}': give a positive factor"):
            scaled(20)


def test_a_subprocess_out_of_time_names_its_timeout_and_the_knob(monkeypatch) -> None:
    monkeypatch.setenv(KNOB, "2")
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    with pytest.raises(AssertionError) as failed:
        run(sleeper, timeout=0.25)
    said = str(failed.value)
    assert said.startswith(f"timeout: {sys.executable} -c import time; time.sleep(30) ran out of")
    assert f"its 0.5 s; on a busy machine set {KNOB} (now 2)" in said


def test_any_failure_that_reads_as_a_timeout_names_the_knob(tmp_path: Path) -> None:
    """subprocess's own TimeoutExpired, raised where no helper catches it: the suite's
    conftest adds the knob to the report."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport\n")
    (tmp_path / "test_slow.py").write_text(
        textwrap.dedent(
            """
            import subprocess, sys

            def test_times_out():
                subprocess.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.2)

            def test_fails_otherwise():
                assert 1 == 2
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")])}
    env.pop(KNOB, None)
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's options (e.g. --cpu-report) are not its
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
         str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    out = done.stdout
    assert "2 failed" in out, out[-3000:]
    hint = f"this failure reads as a timeout: on a busy machine set {KNOB} (now 1)"
    assert out.count(hint) == 1, out[-3000:]
    assert out.index(hint) < out.index("test_fails_otherwise")  # under test_times_out's report


def test_the_knob_lengthens_pytest_timeouts_limit_too(tmp_path: Path) -> None:
    """pyproject.toml's 600 s per test (pytest-timeout) doubles under the knob set to 2."""
    (tmp_path / "timeout_probe.py").write_text(
        "def pytest_sessionstart(session):\n"
        "    print('pytest-timeout limit:', session.config._env_timeout)\n"
    )
    paths = [str(tmp_path), str(REPO), str(REPO / "src")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), KNOB: "2"}
    env.pop("PYTEST_TIMEOUT", None)
    command = [sys.executable, "-m", "pytest", "-p", "timeout_probe", "-p", "no:cacheprovider",
               "-n", "0", "--co", "-q", "tests/unit/test_timeouts.py"]  # fmt: skip
    done = run(command, 120, cwd=REPO, env=env, capture_output=True, text=True)
    assert "pytest-timeout limit: 1200.0" in done.stdout, done.stdout[-2000:]
