"""What a run removes from its directory: only what killed saves of giantpipe left in its own
checkpoint directories, and nothing where a manifest cannot be read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from giantpipe.config import ConfigError
from giantpipe.runner.rundir import clean_interrupted_saves, finished_run, lost_last, resume_point
from tests.unit.checkpoint.saves import save, weights


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
        tmp_path / "last" / ".manifest.json.k2x8_q.tmp",
        tmp_path / "step_9" / ".manifest.json.k2x8_q.tmp",
    ]
    for tmp in ours[1:]:
        tmp.parent.mkdir(exist_ok=True)
        tmp.write_text("{")
    # A folder with no manifest beside it: a first save that was killed, or a save whose manifest
    # was lost (the two look alike); left for the next save into step_9/ to replace.
    uncommitted = leftover(tmp_path / "step_9" / "step000000009-0a1b2c")
    theirs = user_files(tmp_path)
    assert clean_interrupted_saves(tmp_path) == 3
    assert not any(path.exists() for path in ours)
    assert all(path.read_text() == "the user's" for path in theirs)
    assert (tmp_path / "last" / kept / "__0_0.distcp").exists()
    assert (uncommitted / "__0_0.distcp").read_bytes() == b"half"


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


def test_a_run_without_a_committed_last_but_with_its_checkpoints_is_refused(tmp_path) -> None:
    """Issue 32, item 9: `last/manifest.json` missing, good step_N/ beside it: resume=auto
    started over (moving the record aside, deleting last/'s save folder, rewriting step_N/)."""
    run = tmp_path / "run"
    save(run / "step_2", weights())
    save(run / "step_4", weights())
    save(run / "last", weights())
    (run / "last" / "manifest.json").unlink()
    newest = run / "step_4"
    for resume in ("auto", True, False):
        with pytest.raises(ConfigError) as info:
            resume_point(resume, run)
        assert str(info.value) == (
            f"trainer.resume: {run / 'last' / 'manifest.json'} is missing ({run / 'last'} holds "
            f"a save without its commit record); nothing was changed: resume from {newest} "
            f"with trainer.resume={newest}, or choose another hydra.run.dir"
        )
    assert resume_point(str(newest), run) == newest  # what the line says works
    # A completed run asked to go on (max_steps raised) is not skipped as finished either.
    (run / "summary.json").write_text('{"status": "completed", "steps": 4}')
    assert not finished_run("auto", run, 10)
    # No last/ at all, only the kept copies: named too.
    shutil.rmtree(run / "last")
    with pytest.raises(ConfigError, match=r"no checkpoint at .*/last, but .* keeps step_4/"):
        resume_point("auto", run)
    with pytest.raises(ConfigError, match=r"already holds a run \(step_4/manifest.json, no"):
        resume_point(False, run, overwrite=True)
    # A save folder without a manifest and nothing kept: move it aside to start over.
    lone = tmp_path / "lone"
    leftover(lone / "last" / "step000000003-0a1b2c")
    with pytest.raises(ConfigError, match=r"no step_N/ is kept beside it: move .*/last aside"):
        resume_point("auto", lone)
    # An empty last/ (or none) and no kept copy: nothing to lose, a fresh start.
    (tmp_path / "empty" / "last").mkdir(parents=True)
    assert resume_point("auto", tmp_path / "empty") is None
    assert lost_last(tmp_path / "empty", "auto") is None
