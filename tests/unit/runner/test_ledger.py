"""The ledger of kept checkpoints on real step_N/ folders: only giantpipe's own are removed,
a removal is recorded before it starts, and every state a kill can leave is finished (or left
alone) at the next start with every kept checkpoint whole."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from giantpipe.checkpoint.manifest import committed_files, read_manifest, verify
from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.runner import train
from giantpipe.runner.ledger import LEDGER, Ledger, not_ours
from giantpipe.runner.monitor import Monitor
from giantpipe.runner.retention import Retention
from tests.support.runs import tiny


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that kept step_1/, step_2/ and step_3/ (and last/)."""
    run = tmp_path_factory.mktemp("saved")
    train(tiny(max_steps=3, eval_every=0, checkpoint_every=1, predict=False), run, "")
    return run


@pytest.fixture
def run(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def whole(folder: Path) -> int:
    """The step of a checkpoint whose every committed file matches its manifest."""
    manifest = read_manifest(folder)
    verify(folder, manifest, committed_files(manifest))
    return read_checkpoint(folder)["step"]


def save_folder(folder: Path) -> Path:
    return folder / read_manifest(folder)["folder"]


def test_a_checkpoint_of_its_own_step_holding_only_giantpipes_files_is_ours(run: Path):
    assert not_ours(run / "step_2", 2) is None


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda f: (f / "notes.txt").write_text("mine"), "it holds notes.txt, which giantpipe"),
        (lambda f: (f / "eval").mkdir(), "it holds eval, which giantpipe did not write"),
        (
            lambda f: (save_folder(f) / "notes.txt").write_text("mine"),
            "/notes.txt, which giantpipe did not write",
        ),
        (lambda f: (f / "manifest.json").write_text("{}"), "its manifest.json does not read"),
        (lambda f: (f / "manifest.json").unlink(), "its manifest.json does not read"),
    ],
)
def test_a_folder_holding_anything_else_is_not_ours(run: Path, change, problem):
    change(run / "step_2")
    assert problem in (not_ours(run / "step_2", 2) or "")


def test_a_renamed_copy_or_a_link_is_not_ours(run: Path):
    shutil.copytree(run / "step_2", run / "step_5")
    assert not_ours(run / "step_5", 5) == "its manifest is of step 2"
    (run / "step_7").symlink_to(run / "step_2")
    assert not_ours(run / "step_7", 7) == "it is a link or no folder"


def test_remove_records_then_removes_and_keeps_what_is_not_ours(run: Path):
    ledger = Ledger.open(run, step=3)
    assert ledger.written == {1: ["every"], 2: ["every"], 3: ["every"]}
    assert ledger.remove(1, "not among the 2 newest")
    assert not (run / "step_1").exists() and not (run / "step_1.removing").exists()
    (run / "step_2" / "notes.txt").write_text("mine")
    assert not ledger.remove(2, "not among the 2 newest")
    assert (run / "step_2" / "notes.txt").exists() and whole(run / "step_2") == 2
    assert Ledger.read(run).written == {3: ["every"]}  # step_2 left the ledger
    assert Ledger.read(run).removing == []


def killed_while_removing(run: Path, name: str) -> None:
    """The ledger as a kill leaves it after the removal of ``name`` was recorded."""
    ledger = Ledger.open(run, step=3)
    ledger.removing.append(name)
    ledger.written.pop(int(name.split("_")[1]))
    ledger.write()


@pytest.mark.parametrize("point", ["recorded", "set aside", "half erased"])
def test_every_state_a_kill_leaves_is_finished_at_the_next_start(run: Path, point: str):
    killed_while_removing(run, "step_1")
    if point != "recorded":
        (run / "step_1").rename(run / "step_1.removing")
    if point == "half erased":
        (run / "step_1.removing" / "manifest.json").unlink()
        for path in sorted(save_folder_of_aside(run).iterdir())[:2]:
            path.unlink()
    ledger = Ledger.open(run, step=3)
    assert ledger.removing == [] and Ledger.read(run).removing == []
    assert not (run / "step_1.removing").exists()
    if point == "recorded":  # never set aside: whole, and kept until decided again
        assert whole(run / "step_1") == 1 and 1 in ledger.written
    else:
        assert not (run / "step_1").exists() and 1 not in ledger.written
    assert [whole(run / f"step_{n}") for n in (2, 3)] == [2, 3] and whole(run / "last") == 3


def save_folder_of_aside(run: Path) -> Path:
    (folder,) = [p for p in (run / "step_1.removing").iterdir() if p.is_dir()]
    return folder


def test_a_folder_set_aside_is_left_if_it_holds_a_strangers_file_or_the_ledger_lost_it(
    run: Path,
):
    killed_while_removing(run, "step_1")
    (run / "step_1").rename(run / "step_1.removing")
    (run / "step_1.removing" / "notes.txt").write_text("mine")
    (run / "step_2").rename(run / "step_2.removing")  # not in the ledger: not known as ours
    Ledger.open(run, step=3)
    assert (run / "step_1.removing" / "notes.txt").exists()
    assert (run / "step_2.removing" / "manifest.json").exists()
    assert Ledger.read(run).removing == []


def test_open_forgets_a_course_the_run_left_and_adopts_what_is_on_disk(run: Path):
    ledger = Ledger(run, {1: {"eval/loss": 0.5}, 3: {"eval/loss": 0.4}})
    ledger.written = {1: ["best"], 2: ["every"], 9: ["best"]}  # no step_9/ on disk
    ledger.write()
    reopened = Ledger.open(run, step=2)  # resumed from step 2
    assert reopened.evaluations == {1: {"eval/loss": 0.5}}
    # step_3/ is the left course's: not the run's to remove (it is rewritten at step 3)
    assert reopened.written == {1: ["best"], 2: ["every"]}


def test_an_unreadable_ledger_is_started_anew_saying_so(run: Path, caplog):
    (run / LEDGER).write_text("{torn")
    with caplog.at_level(logging.WARNING):
        ledger = Ledger.open(run, step=3)
    assert "does not read" in caplog.text
    assert ledger.written == {1: ["every"], 2: ["every"], 3: ["every"]}
    assert json.loads((run / LEDGER).read_text())["format"] == "giantpipe-kept/1"


def test_prune_keeps_a_save_still_in_flight(run: Path):
    ledger = Ledger.open(run, step=3)
    retention = Retention(ledger, Monitor("eval/loss", "min"), keep_last=1, keep_best=0)
    retention.pending.add(3)  # trainer.async_save: written, not committed yet
    retention.prune()
    assert sorted(p.name for p in run.glob("step_*")) == ["step_2", "step_3"]
    assert retention.removed == [1]
    retention.committed(3)
    assert sorted(p.name for p in run.glob("step_*")) == ["step_3"]
    assert retention.summary() == {"step_3": "among the 1 newest (trainer.keep_last)"}


def test_nothing_is_removed_while_the_removal_cannot_be_recorded(run: Path, caplog):
    ledger = Ledger.open(run, step=3)
    (run / LEDGER).unlink()
    (run / LEDGER).mkdir()  # the ledger cannot be replaced (as on a full disk)
    with caplog.at_level(logging.WARNING):
        assert not ledger.remove(1, "not among the 2 newest")
    assert "not written" in caplog.text and whole(run / "step_1") == 1
    assert ledger.written[1] == ["every"] and ledger.removing == []  # tried again later
    (run / LEDGER).rmdir()
    assert ledger.remove(1, "not among the 2 newest") and not (run / "step_1").exists()
