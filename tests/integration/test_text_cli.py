"""``python train.py data=text`` with files that cannot be read: one line on stderr naming the key,
the file and the line, a non-zero exit, and no run directory left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timeouts import scaled

REPO = Path(__file__).resolve().parents[2]


def train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), "recipe=llama_text", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ("[corpus/*.txt]", "error: data.files: 'corpus/*.txt' matches no file; give data.files="),
        (
            "[bad.jsonl]",
            "error: data.files: bad.jsonl, line 3: not JSON (Expecting ',' delimiter); expected "
            "one JSON object per line with the fields text",
        ),
    ],
)
def test_unreadable_text_is_one_line_naming_the_file_and_the_line(files, expected, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n\n{"text": "two"\n')
    result = train(f"data.files={files}", "logger.progress=none", cwd=tmp_path)
    assert result.returncode == 2  # a refused config, as every refused key (cli.guarded)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
    assert not (tmp_path / "outputs").exists()  # a refused config leaves the disk as it was
