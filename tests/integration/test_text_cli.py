"""``python train.py data=text`` with files that cannot be read: one line on stderr naming the key,
the file and the line, a non-zero exit, and no run directory left behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.train import train


def train_text(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return train("recipe=llama_text", *args, cwd=cwd)


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
    result = train_text(f"data.files={files}", "logger.progress=none", cwd=tmp_path)
    assert result.returncode == 2  # a refused config, as every refused key (cli.guarded)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
    assert not (tmp_path / "outputs").exists()  # a refused config leaves the disk as it was
