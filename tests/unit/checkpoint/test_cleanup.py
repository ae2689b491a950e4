"""Removing a whole checkpoint (retention): all of it or none of it readable, a killed removal
finished at the next start, and nothing removed that giantpipe did not write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint import cleanup
from giantpipe.checkpoint.cleanup import remove_checkpoint, set_aside
from giantpipe.checkpoint.errors import CheckpointError
from giantpipe.checkpoint.load import load
from giantpipe.runner.rundir import clean_interrupted_saves, kept_beside
from tests.unit.checkpoint.saves import save, weights


def test_a_checkpoint_is_removed_whole_and_nothing_beside_it(tmp_path: Path) -> None:
    save(tmp_path / "step_2", weights(), step=2)
    save(tmp_path / "step_4", weights(), step=4)
    (tmp_path / "notes.txt").write_text("the user's")
    remove_checkpoint(tmp_path / "step_2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step_4"]
    assert torch.equal(load(tmp_path / "step_4")["0.bias"], weights()["0.bias"])


def test_a_checkpoint_holding_what_giantpipe_did_not_write_is_left_whole(tmp_path: Path) -> None:
    token = save(tmp_path / "step_2", weights(), step=2)
    (tmp_path / "step_2" / "notes.txt").write_text("the user's")
    with pytest.raises(CheckpointError, match=r"step_2 holds notes.txt, which giantpipe did not"):
        remove_checkpoint(tmp_path / "step_2")
    assert sorted(p.name for p in (tmp_path / "step_2").iterdir()) == [
        "manifest.json",
        "notes.txt",
        token,
    ]
    assert load(tmp_path / "step_2").keys() == weights().keys()


def test_a_removal_killed_half_way_leaves_no_checkpoint_to_read(tmp_path, monkeypatch) -> None:
    save(tmp_path / "step_2", weights(), step=2)
    save(tmp_path / "step_4", weights(), step=4)
    (tmp_path / ".mine.removing-abcdef").mkdir()  # our pattern, the user's folder
    (tmp_path / ".mine.removing-abcdef" / "notes.txt").write_text("the user's")

    def killed(path: Path, *args: object, **kwargs: object) -> None:
        (path / "manifest.json").unlink()  # part of the deletion done, then the kill
        raise KeyboardInterrupt

    monkeypatch.setattr(cleanup.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        remove_checkpoint(tmp_path / "step_4")
    monkeypatch.undo()
    assert not (tmp_path / "step_4").exists()  # never a step_4/ torn under its own name
    assert kept_beside(tmp_path / "last") == tmp_path / "step_2"
    (aside,) = set_aside(tmp_path)
    assert aside.name.startswith(".step_4.removing-")
    assert clean_interrupted_saves(tmp_path) == 1  # the next start finishes the removal
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mine.removing-abcdef", "step_2"]
