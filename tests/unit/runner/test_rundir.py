"""What a run removes from its directory: only what killed saves of giantpipe left in its own
checkpoint directories, and nothing where a manifest cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from giantpipe.config import ConfigError
from giantpipe.runner.rundir import clean_interrupted_saves, resume_point
from tests.unit.engine.dist.test_shards import save, weights


def leftover(folder: Path) -> Path:
    """What a save killed before its commit leaves: a folder of DCP files, no manifest."""
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"half")
    (folder / ".metadata.tmp").write_bytes(b"half")
    return folder


def user_files(run: Path) -> list[Path]:
    files = [
        run / "notes.tmp",
        run / "last" / "notes.tmp",
        run / "step_7" / "step1-rank0.pt",
        run / "last" / "step000000003-abcdef" / "mine.txt",  # our folder name, not our file
        run / "last" / "plan.pt",
    ]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("the user's")
    return files


def test_cleaning_removes_only_what_giantpipe_wrote(tmp_path: Path) -> None:
    kept = save(tmp_path / "last", weights())
    ours = [
        leftover(tmp_path / "last" / "step000000002-0a1b2c"),
        leftover(tmp_path / "step_9" / "step000000009-0a1b2c"),  # a first save, never committed
        tmp_path / "last" / ".manifest.json.k2x8_q.tmp",
    ]
    ours[-1].write_text("{")
    theirs = user_files(tmp_path)
    assert clean_interrupted_saves(tmp_path) == 3
    assert not any(path.exists() for path in ours)
    assert all(path.read_text() == "the user's" for path in theirs)
    assert (tmp_path / "last" / kept / "__0_0.distcp").exists()


def test_nothing_is_removed_where_the_manifest_cannot_be_read(tmp_path: Path) -> None:
    save(tmp_path / "last", weights())
    stray = leftover(tmp_path / "last" / "step000000002-0a1b2c")
    manifest = tmp_path / "last" / "manifest.json"
    manifest.write_text(manifest.read_text().replace("{", "x", 1))  # one character damaged
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert clean_interrupted_saves(tmp_path) == 0
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (stray / "__0_0.distcp").exists()


def test_a_run_may_resume_from_its_own_kept_step_but_not_from_another_run(tmp_path) -> None:
    save(tmp_path / "run" / "last", weights())
    save(tmp_path / "run" / "step_2", weights())
    own = tmp_path / "run" / "step_2"
    assert resume_point(str(own), tmp_path / "run") == own
    save(tmp_path / "other" / "last", weights())
    with pytest.raises(ConfigError, match="holds another run's last/manifest.json"):
        resume_point(str(tmp_path / "other" / "last"), tmp_path / "run")
