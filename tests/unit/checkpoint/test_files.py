"""Files written whole or not at all: a failed write leaves the previous file, and no temporary."""

from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.files import atomic_save


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("boom")


def test_atomic_save_replaces_whole_file_and_leaves_no_temp(tmp_path: Path):
    path = tmp_path / "last.pt"
    atomic_save({"step": 1}, path)
    atomic_save({"step": 2}, path)
    assert torch.load(path)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path):
    path = tmp_path / "last.pt"
    atomic_save({"step": 1}, path)
    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
