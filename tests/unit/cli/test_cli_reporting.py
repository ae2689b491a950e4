"""Under torchrun a refused config is said once: the first rank of the host to refuse it prints
the line, the others wait for it to have exited and stay quiet; another line is said again."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from giantpipe.cli.job import first_to_refuse


def test_only_the_first_rank_to_refuse_a_config_says_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert first_to_refuse("trainer.max_steps: must be >= 1, got -1")  # no torchrun: always
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert first_to_refuse("trainer.max_steps: must be >= 1, got -1")
    (marker,) = tmp_path.iterdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    marker.write_text(gone.stdout.strip())  # the first rank has said it and exited
    start = time.monotonic()
    assert not first_to_refuse("trainer.max_steps: must be >= 1, got -1")
    assert time.monotonic() - start < 2.0
    assert first_to_refuse("data.root: directory not found: /no/such/dir")  # another line


def test_a_quiet_rank_waits_for_the_one_that_reports(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    reporter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.8)"])
    assert first_to_refuse("optim.lr: must be > 0, got 0")
    (marker,) = tmp_path.iterdir()
    marker.write_text(str(reporter.pid))  # it is still printing
    start = time.monotonic()
    assert not first_to_refuse("optim.lr: must be > 0, got 0")
    waited = time.monotonic() - start
    reporter.wait()
    assert 0.3 <= waited < 4.0  # until it exited (not reaped yet), not the 5 s of patience


WARNS = """
import sys, warnings
from pathlib import Path
from giantpipe.cli import guarded

class TimingNoise(UserWarning):  # giantpipe.perf.stage_profile's, here without torch
    pass

TimingNoise.__module__ = "giantpipe.perf.stage_profile"
sys.argv = ["train.py"]
guarded(lambda: warnings.warn(TimingNoise("layer 0 (Sequential): timings spread more than 50%\\n"
                                          "(the machine is busy): the medians are kept")),
        Path(sys.argv[0]).parent / "conf")
"""


def test_a_warning_of_the_run_is_one_line(tmp_path: Path) -> None:
    """A TimingNoise on a busy machine printed the line of source that warned under it."""
    repo = Path(__file__).resolve().parents[3]
    (tmp_path / "conf").symlink_to(repo / "conf")
    env = {"PYTHONPATH": f"{repo / 'src'}:{repo}"}
    command = [sys.executable, "-c", WARNS]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "warning: TimingNoise: layer 0 (Sequential): timings spread more than 50%; (the machine "
        "is busy): the medians are kept"
    ]
