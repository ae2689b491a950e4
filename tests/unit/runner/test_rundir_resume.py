"""Issue 22, items 8 and 9: a resume continues the same run (its seed, model and data), and
``trainer.resume=auto`` resumes, starts or skips, so that one command restarts a sweep."""

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from giantpipe.config import ConfigError
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from giantpipe.runner.rundir import check_resumed_config, resume_point
from tests.support.runs import tiny

SAVED = {
    "name": "run",
    "model": {"hidden": 16, "in_features": 16, "dropout": 0.0},
    "data": {"features": 16, "batch_size": 64, "root": None},
    "pipeline": {"chunks": 4, "executor": "local"},
    "optim": {"lr": 0.001, "lr_schedule": {"name": "cosine"}},
    "trainer": {"seed": 0, "max_steps": 10, "eval_every": 5},
}


def config(**changes: dict) -> str:
    """SAVED with ``group={key: value}`` changes, as the entry point writes config.yaml."""
    tree = {
        group: {**values, **changes.get(group, {})}
        for group, values in SAVED.items()
        if group != "name"
    }
    return "# overrides: recipe=mlp_quickstart\n" + yaml.safe_dump({"name": "run", **tree})


def refusal(run: Path, now: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        check_resumed_config(run / "last", 10, now, **kwargs)
    return str(caught.value)


def test_a_changed_seed_model_or_data_is_refused_naming_keys_and_values(tmp_path: Path):
    (tmp_path / "config.yaml").write_text(config())
    now = config(trainer={"seed": 1}, data={"batch_size": 32})
    line = refusal(tmp_path, now)
    assert "\n" not in line
    assert line.startswith("data.batch_size, trainer.seed: changed from the run being resumed (")
    assert f"{tmp_path / 'config.yaml'}: data.batch_size 64 -> 32, trainer.seed 0 -> 1)" in line
    assert line.endswith(
        "set them back, or pass trainer.resume_changed=[data.batch_size,trainer.seed] if the "
        "change is meant"
    )
    # Named as meant, by key or by group, the change is taken.
    check_resumed_config(tmp_path / "last", 10, now, allowed=["trainer.seed", "data"])
    assert refusal(tmp_path, now, allowed=["trainer.seed"]).startswith("data.batch_size: ")
    # A key the saved run did not have, and a model key.
    line = refusal(tmp_path, config(model={"dropout": 0.1, "norm": "layer"}))
    assert "model.dropout 0.0 -> 0.1, model.norm (absent) -> layer" in line


def test_what_a_resume_may_change_freely(tmp_path: Path):
    """Steps, evaluation, the LR schedule, the pipeline's shape (resharding under another K, R or
    executor is a feature), and keys an interpolation sets, which follow their source."""
    (tmp_path / "config.yaml").write_text(config())
    free = config(
        pipeline={"chunks": 8, "executor": "distributed"},
        trainer={"max_steps": 40, "eval_every": 10},
        optim={"lr_schedule": {"name": "constant"}},
    )
    check_resumed_config(tmp_path / "last", 10, free)
    derived = config(model={"in_features": 32})
    assert refusal(tmp_path, derived).startswith("model.in_features: ")
    check_resumed_config(tmp_path / "last", 10, derived, derived=["model.in_features"])


def test_the_config_compared_is_the_one_the_checkpoint_continues(tmp_path: Path):
    """A run resumed at step 10 with a new seed (meant) saved config.resume_10.yaml: a checkpoint
    after step 10 continues that config, one before it the original."""
    (tmp_path / "config.yaml").write_text(config())
    (tmp_path / "config.resume_10.yaml").write_text(config(trainer={"seed": 7}))
    check_resumed_config(tmp_path / "step_12", 12, config(trainer={"seed": 7}))
    check_resumed_config(tmp_path / "step_5", 5, config())
    with pytest.raises(ConfigError, match=r"trainer.seed 7 -> 0"):
        check_resumed_config(tmp_path / "step_12", 12, config())
    # A copied checkpoint with no saved config beside it is not compared.
    check_resumed_config(tmp_path / "copied" / "last", 12, config(trainer={"seed": 3}))


def fingerprint(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]


def test_resume_auto_starts_resumes_or_skips(tmp_path: Path, capsys):
    run = tmp_path / "run"
    assert resume_point("auto", run) is None  # nothing there: a fresh start
    first = train(tiny(max_steps=2, log_every=1, eval_every=0, resume="auto"), run, "")
    assert first["status"] == "completed" and steps(run) == [1, 2]

    # Complete: skipped, nothing changed, its summary handed back (a sweep's objective).
    before = fingerprint(run)
    again = train(tiny(max_steps=2, log_every=1, eval_every=0, resume="auto"), run, "")
    assert again == json.loads((run / "summary.json").read_text())
    assert fingerprint(run) == before
    assert "the run is complete at step 2; nothing was changed" in capsys.readouterr().out

    # Asked for more steps, it resumes from its checkpoint.
    assert resume_point("auto", run) == resume_point(True, run)
    train(tiny(max_steps=4, log_every=1, eval_every=0, resume="auto"), run, "")
    assert steps(run) == [1, 2, 3, 4]

    # A run that failed before its first checkpoint starts over; its record is moved aside.
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    (failed / "summary.json").write_text('{"status": "failed", "steps": 1}')
    with pytest.raises(ConfigError, match="holds another run's record"):
        resume_point(False, failed)
    train(tiny(max_steps=2, log_every=1, eval_every=0, resume="auto"), failed, "")
    assert steps(failed) == [1, 2]
    assert json.loads((failed / "replaced-1" / "summary.json").read_text())["status"] == "failed"


def test_a_run_saved_before_its_data_builder_moved_resumes_and_rebuilds(tmp_path: Path):
    """Issue 31 moved the data builders: a run saved with the old ``_target_`` resumes (the
    builder is the same) and its config still builds; a really different builder is refused."""
    from giantpipe.runner.registry import locate

    old, new = "giantpipe.data.tensors.classification", "giantpipe.data.synthetic.classification"
    (tmp_path / "config.yaml").write_text(config(data={"_target_": old}))
    check_resumed_config(tmp_path / "last", 10, config(data={"_target_": new}))
    assert locate(old, "data._target_") is locate(new, "data._target_")
    other = "giantpipe.data.lm_tokens.lm_tokens"
    assert refusal(tmp_path, config(data={"_target_": other})).startswith("data._target_: ")
