"""``python train.py`` end to end in subprocesses: outputs, resume, sweeps and bad input."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from giantpipe.checkpoint.run import read_checkpoint
from tests.support.runs import QUICK_MLP
from tests.support.train import command, environment, ok, one_error_line, train, train_here
from tests.timeouts import run

pytestmark = pytest.mark.slow  # every test runs python train.py end to end (torch, training)

TINY = QUICK_MLP


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def fingerprint(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted 20-step run (the reference: the same job, trained in this process), and
    a 10-step train.py run with a copy of its step-10 checkpoint."""
    root = tmp_path_factory.mktemp("runs")
    assert train_here(root / "full", *TINY, "trainer.max_steps=20")["status"] == "completed"
    ok(train(*TINY, "trainer.max_steps=10", f"hydra.run.dir={root / 'part'}", cwd=root))
    shutil.copytree(root / "part" / "last", root / "step10")
    return {"root": root, "full": root / "full", "part": root / "part", "ckpt": root / "step10"}


def test_five_step_run_writes_metrics_checkpoint_and_summary(tmp_path: Path):
    result = ok(train(*TINY, "trainer.max_steps=5", cwd=tmp_path))
    (run_dir,) = (tmp_path / "outputs").glob("*/*")  # outputs/DATE/TIME
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5]
    assert read_checkpoint(run_dir / "last")["step"] == 5
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    config = (run_dir / "config.yaml").read_text()
    assert config.startswith("# overrides: recipe=mlp_quickstart data.train_size=512")
    assert "max_steps: 5" in config
    assert "in_features: 16" in config  # interpolations resolved
    assert "samples/s" in result.stdout and "bubble, measured" in result.stdout


def test_a_log_that_is_no_terminal_gets_progress_lines(tmp_path: Path):
    # stdout to a file, as under nohup or a cluster job: no bar, but a progress line at every
    # trainer.log_every step, and between them at least one every logger.progress_every_s
    said = {}
    for name, knobs in {
        "by_step": ["trainer.log_every=4", "logger.progress_every_s=3600"],
        "by_time": ["trainer.log_every=1000", "logger.progress_every_s=1e-9"],
    }.items():
        run_dir, out = tmp_path / name, tmp_path / f"{name}.out"
        args = [*TINY, *knobs, "trainer.max_steps=8", f"hydra.run.dir={run_dir}"]
        with out.open("w") as stdout:
            run(command(*args), 120, cwd=tmp_path, env=environment(), stdout=stdout, check=True)
        lines = [line for line in out.read_text().splitlines() if "samples/s, ETA" in line]
        assert lines == [
            line for line in (run_dir / "train.log").read_text().splitlines() if "ETA" in line
        ]
        said[name] = [line.split(" - ", 1)[1].split(":")[0] for line in lines]
    assert said["by_step"] == ["step 4/8", "step 8/8"]
    assert said["by_time"] == [f"step {s}/8" for s in range(1, 9)]


def test_an_interleaved_schedule_runs_from_the_command_line(tmp_path: Path):
    # pipeline.virtual_stages is null by default, as PipelineSpec's: V is the schedule's (2), so
    # naming the schedule is enough, as it is for GPipe(..., schedule="interleaved")
    run_dir = tmp_path / "run"
    ok(train(*TINY, "trainer.max_steps=2", "pipeline.schedule=interleaved",
             f"hydra.run.dir={run_dir}", cwd=tmp_path))  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert len(summary["pipeline/balance"]) == 4 and len(summary["pipeline/devices"]) == 2


def test_resume_gives_the_same_losses_for_steps_11_to_20(runs):
    ok(
        train(
            *TINY,
            "trainer.max_steps=20",
            "trainer.resume=true",
            f"hydra.run.dir={runs['part']}",
            cwd=runs["root"],
        )
    )
    full, resumed = losses(runs["full"]), losses(runs["part"])
    assert sorted(resumed) == list(range(1, 21))
    assert [resumed[s] for s in range(11, 21)] == [full[s] for s in range(11, 21)]


def test_resume_with_another_number_of_stages(runs, tmp_path: Path):
    ok(
        train(
            *TINY,
            "trainer.max_steps=20",
            f"trainer.resume={runs['ckpt']}",
            "pipeline.num_devices=3",
            f"hydra.run.dir={tmp_path / 'k3'}",
            cwd=tmp_path,
        )
    )
    assert read_checkpoint(runs["ckpt"])["balance"] == [2, 2]
    summary = json.loads((tmp_path / "k3" / "summary.json").read_text())
    assert len(summary["pipeline/balance"]) == 3
    full, resumed = losses(runs["full"]), losses(tmp_path / "k3")
    assert sorted(resumed) == list(range(11, 21))
    assert [resumed[s] for s in range(11, 21)] == pytest.approx(
        [full[s] for s in range(11, 21)], rel=1e-4
    )


def test_multirun_runs_every_job_even_when_one_fails(tmp_path: Path):
    result = train("-m", *TINY, "trainer.max_steps=3", "pipeline.chunks=0,2", cwd=tmp_path)
    assert result.returncode == 2  # a refused config, even one job's, is a usage error
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: job 0 (") and "pipeline.chunks=0)" in errors[0]
    assert errors[0].endswith(": pipeline.chunks: must be >= 1, got 0")
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    assert json.loads((sweep_dir / "1" / "summary.json").read_text())["status"] == "completed"
    assert not (sweep_dir / "0" / "last").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["trainer.foo=1"], "error: trainer.foo: unknown key"),
        (
            ["model=nonexistent"],
            "error: model=nonexistent: no such option (available: amoebanet_b, amoebanet_d, "
            "hf_causal_lm",
        ),
        (["trainer.max_steps=ten"], "error: trainer.max_steps: Value 'ten' of type 'str'"),
        (
            ["pipeline.checkpoint=always"],
            "error: pipeline.checkpoint: renamed to pipeline.recompute",
        ),
        (
            ["data=tensors", "data.root=/no/such/dir", "data.features=4", "data.classes=2"],
            "error: data.root: directory not found: /no/such/dir",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_key(args, expected, tmp_path: Path):
    line = one_error_line(
        train("recipe=mlp_quickstart", "trainer.max_steps=1", *args, cwd=tmp_path)
    )
    assert line.startswith(expected)


def test_a_model_that_cannot_be_built_on_meta_is_one_line_naming_the_key(tmp_path: Path):
    user = "model._target_=tests.unit.runner.meta_models.item_in_init"  # .item() in __init__
    result = train(*TINY, "trainer.max_steps=1", user, cwd=tmp_path)
    assert result.returncode == 2
    line = one_error_line(result)
    assert line.startswith("error: pipeline.build: the model cannot be built without its"), line
    assert "pipeline.build=host" in line
    assert not list(tmp_path.rglob("config.yaml"))  # nothing written
    ok(train(*TINY, "trainer.max_steps=1", user, "pipeline.build=host", cwd=tmp_path))


def test_unwritable_output_directory_is_one_line_naming_it(tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    line = one_error_line(train(*TINY, f"hydra.run.dir={blocker / 'run'}", cwd=tmp_path))
    assert str(blocker / "run") in line


def test_incompatible_resume_is_one_line_and_overwrites_nothing(runs, tmp_path: Path):
    run_dir = tmp_path / "copy"
    shutil.copytree(runs["part"], run_dir)
    before = fingerprint(run_dir)
    line = one_error_line(
        train(
            *TINY,
            "model.hidden=32",
            "trainer.resume=true",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
        )
    )
    assert line.startswith(f"error: trainer.resume: {run_dir / 'last'} does not fit this model")
    after = {k: v for k, v in fingerprint(run_dir).items() if k != "train.log"}
    assert after == {k: v for k, v in before.items() if k != "train.log"}


def test_diverging_run_stops_without_saving_and_leaves_a_traceback(tmp_path: Path):
    """lr=1e30: step 1's update makes the weights non-finite, so its evaluation is NaN: the run
    stops there and saves nothing as good (issue 13, item 8)."""
    run_dir = tmp_path / "run"
    args = ["optim.name=sgd", "optim.lr=1e30", "model.norm=none", "trainer.eval_every=1"]
    line = one_error_line(
        train(*TINY, "trainer.max_steps=5", *args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    )
    assert line.startswith(
        "error: NonFiniteLossError: step 1: the evaluation loss is nan; stopped without saving "
        "(no checkpoint was written)"
    )
    assert not (run_dir / "last").exists()
    assert "Traceback" in (run_dir / "error.txt").read_text()


@pytest.mark.slow
def test_mlp_quickstart_finishes_and_the_loss_falls(tmp_path: Path):
    result = ok(train("recipe=mlp_quickstart", cwd=tmp_path, timeout=300))
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    first = losses(run_dir)[min(losses(run_dir))]
    assert summary["name"] == "mlp_quickstart" and summary["steps"] == 300
    assert summary["eval/loss"] < 0.6 < 1.5 < first
    assert "eval loss" in result.stdout


def test_wandb_offline_multirun_gives_each_job_its_own_finished_run(tmp_path: Path):
    pytest.importorskip("wandb")
    ok(
        train(
            "-m", *TINY, "trainer.max_steps=2", "logger=wandb", "pipeline.chunks=1,2", cwd=tmp_path
        )
    )
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    for job in ("0", "1"):
        (run,) = (sweep_dir / job / "wandb").glob("offline-run-*")
        assert list(run.glob("run-*.wandb")), f"job {job} has no W&B run file"
