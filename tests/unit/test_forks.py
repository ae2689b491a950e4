"""tests/support/forks.py: a script forked from the tests' server behaves as ``python SCRIPT``
would (output, status, environment, working folder, ``sys.argv``, ``sys.path[0]``, threads and
``atexit`` at its end, an uncaught exception's traceback), and a run out of time is killed."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.forks import REPO, exit_status, forkable, forked_cpu, run_script
from tests.timeouts import scaled

SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "name", __name__)
print("cwd", os.getcwd(), "env", os.environ.get("FORK_TEST"), "path0", sys.path[0])
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""


def both(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    """The script run fresh and forked, with the same arguments, folder and environment."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "FORK_TEST": "given"}
    fresh = subprocess.run(
        [sys.executable, str(script), *args], cwd=work, env=env, capture_output=True, text=True
    )
    return fresh, run_script(script, list(args), work, env, timeout=60)


@pytest.mark.parametrize("args", [["0"], ["3", "x"], ["bye"], ["raise"]])
def test_a_forked_script_ends_as_a_fresh_one(tmp_path: Path, args: list[str]) -> None:
    fresh, forked = both(tmp_path, *args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr,
    )  # fmt: skip
    assert "atexit ran" in forked.stdout and "thread joined" in forked.stdout


def test_the_exit_status_of_a_system_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert [exit_status(None), exit_status(0), exit_status(3), exit_status("bye")] == [0, 0, 3, 1]
    assert capsys.readouterr().err == "bye\n"


def test_a_run_out_of_time_is_killed_and_says_so(tmp_path: Path) -> None:
    script = tmp_path / "sleeps.py"
    script.write_text("import os, time\nopen('pid', 'w').write(str(os.getpid()))\ntime.sleep(999)")
    start, said = time.monotonic(), f"timeout: .*sleeps.py ran out of its {scaled(2):g} s"
    with pytest.raises(AssertionError, match=said):
        run_script(script, [], tmp_path, dict(os.environ), timeout=2)
    assert time.monotonic() - start < scaled(2) + 30
    assert not Path(f"/proc/{(tmp_path / 'pid').read_text()}").exists()


def test_a_forked_runs_cpu_is_counted(tmp_path: Path) -> None:
    script = tmp_path / "burns.py"
    script.write_text("import time\nwhile time.process_time() < 1.2: pass\n")
    before = forked_cpu()
    assert run_script(script, [], tmp_path, dict(os.environ), timeout=60).returncode == 0
    assert forked_cpu() - before >= 0.9


@pytest.mark.parametrize(
    ("script", "env", "expected"),
    [
        (REPO / "train.py", None, True),
        (REPO / "recipes" / "table2_throughput.py", {"X": "1"}, True),
        (REPO / "train.py", {"PYTHONPATH": "/elsewhere"}, False),
        (Path("/tmp/other-checkout/train.py"), None, False),
    ],
)  # fmt: skip
def test_what_a_fork_can_show(script: Path, env: dict[str, str] | None, expected: bool) -> None:
    assert forkable(script, env) is expected


def test_a_server_importing_another_checkouts_giantpipe_forks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    elsewhere = importlib.machinery.ModuleSpec("giantpipe", None, origin="/other/src/giantpipe")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: elsewhere)
    assert not forkable(REPO / "train.py", None)


def test_a_forked_script_gets_the_thread_count_its_environment_asks(tmp_path: Path) -> None:
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint(torch.get_num_threads())\n")
    for threads in ("1", "3"):
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        assert run_script(script, [], tmp_path, env, timeout=60).stdout == f"{threads}\n"


def test_counting_forked_cpu_survives_a_thread_that_ended_meanwhile(tmp_path: Path) -> None:
    # A worker's thread that ended between the listing of /proc/self/task and the read of its
    # children once failed a test's teardown (and pytest, with an internal error); a folder
    # where the file should be reads with an OSError as the vanished file did.
    (tmp_path / "7" / "children").mkdir(parents=True)
    assert forked_cpu(tmp_path) == 0.0
