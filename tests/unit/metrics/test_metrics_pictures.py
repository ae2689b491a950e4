"""Sinks and pictures: the TensorBoard sink holds the scalars; every run draws curves.png (its
pixels checked); a sweep's table lists every job (refused ones too) with its swept keys and
objective."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from giantpipe.config import LoggerConfig
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.step import StepRecord
from giantpipe.metrics.sweep import write_sweep_table

PNG = b"\x89PNG\r\n\x1a\n"


def record(step: int, loss: float) -> StepRecord:
    stats = SimpleNamespace(
        wall_time_s=1.0,
        span_s=1.0,
        busy_time_s=[0.1, 0.2],
        recompute_time_s=[0.0, 0.0],
        bubble=0.25,
        expected_bubble=0.2,
        peak_memory_bytes=[10, 20],
        memory_kind="saved_activations",
        clock="perf_counter",
    )
    figures = dict(step=step, loss=loss, lr=0.1, step_time_s=0.5, samples=32, tokens=None)
    return StepRecord.from_engine([stats], **figures)


def run(tmp_path: Path, **logger) -> MetricsLogger:
    metrics = MetricsLogger(
        LoggerConfig(progress="none", **logger), tmp_path, 4, 0, 2, name="t", config={}
    )
    for step in range(1, 5):
        metrics.train_step(record(step, loss=2.0 / step))
    metrics.evaluation(4, {"loss": 0.7, "accuracy": 0.5})
    metrics.close({"steps": 4})
    return metrics


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, tensorboard=True)
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "eval/loss", "eval/accuracy"} <= tags
    assert {"train/busy_time_s/stage0", "train/busy_time_s/stage1"} <= tags
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(2, 1.5), (4, pytest.approx((2 / 3 + 2 / 4) / 2))]  # window means
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(4, 0.5)]


def test_no_event_file_unless_asked(tmp_path: Path) -> None:
    run(tmp_path)
    assert not (tmp_path / "tensorboard").exists()


def drawn_in(image: np.ndarray, colour: str) -> tuple[np.ndarray, np.ndarray]:
    """The rows and columns of ``image``'s pixels of ``colour`` (a matplotlib colour name)."""
    from matplotlib.colors import to_rgb

    want = np.array(to_rgb(colour))
    return np.nonzero(np.abs(image[..., :3] - want).max(axis=-1) < 0.02)


@pytest.mark.parametrize("jsonl", [True, False])
def test_every_run_draws_its_loss_and_evaluation_curves(tmp_path: Path, jsonl: bool) -> None:
    """curves.png, read back as pixels, is the picture of what the run logged (the loss's window
    means 1.5 and 0.58 at steps 2 and 4, the evaluation at 4), and that picture holds curves: a
    loss panel where the training loss (tab:blue) falls from left to right across it and the
    evaluation loss (tab:red) is a point at its last step, an accuracy panel with its point."""
    from giantpipe.metrics.curves import plot_curves, pyplot

    run(tmp_path, jsonl=jsonl)
    path = tmp_path / "curves.png"
    assert path.read_bytes().startswith(PNG)
    image = pyplot().imread(path)
    logged = [
        {"kind": "train", "step": 2, "loss": 1.5},
        {"kind": "train", "step": 4, "loss": (2 / 3 + 2 / 4) / 2},
        {"kind": "eval", "step": 4, "loss": 0.7, "accuracy": 0.5},
    ]
    drawn = plot_curves(logged, tmp_path / "logged.png")
    assert drawn is not None
    assert np.array_equal(image, pyplot().imread(drawn)), "not the picture of what was logged"
    assert image.shape[:2] == (400, 2 * 550)  # two panels of 5.5 x 4 inches at 100 dpi
    loss, accuracy = image[:, :550], image[:, 550:]
    rows, columns = drawn_in(loss, "tab:blue")
    assert columns.size > 0, "no training loss drawn"
    first, last = columns.min(), columns.max()
    assert last - first > 550 / 2  # a line across the panel, not only the legend's key
    assert rows[columns == first].mean() < rows[columns == last].mean()  # falling: 1.5 to 0.58
    _, red = drawn_in(loss, "tab:red")
    assert red.size > 0, "no evaluation loss drawn"
    assert abs(int(red.max()) - int(last)) < 10  # the evaluation's point at step 4
    assert drawn_in(accuracy, "C0")[0].size > 0, "no evaluation accuracy drawn"


def job(sweep: Path, number: int, overrides: str, summary: dict | None) -> None:
    folder = sweep / str(number)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"# overrides: {overrides}\nname: x\n")
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))


def test_sweep_table_lists_every_job_against_its_objective(tmp_path: Path) -> None:
    job(tmp_path, 1, "recipe=a pipeline.chunks=2 optim.lr=0.1", {"status": "completed",
        "eval/loss": 0.5})  # fmt: skip
    job(tmp_path, 2, "recipe=a pipeline.chunks=4 optim.lr=0.1", {"status": "failed"})
    launched = {0: ["recipe=a", "pipeline.chunks=0", "optim.lr=0.1"], 1: [], 2: []}
    md, csv, png = write_sweep_table(tmp_path, "eval/loss", launched)
    assert csv.read_text().splitlines() == [
        "job,pipeline.chunks,status,eval/loss",
        "0,0,refused,nan",
        "1,2,completed,0.5",
        "2,4,failed,nan",
    ]
    assert "| 1 | 2 | completed | 0.5 |" in md.read_text()
    assert png.read_bytes().startswith(PNG)
    assert math.isnan(float(csv.read_text().splitlines()[1].rsplit(",", 1)[1]))


def test_starting_over_moves_the_curves_and_events_aside_with_the_record(tmp_path: Path) -> None:
    from giantpipe.runner.rundir import move_record_aside

    run(tmp_path, tensorboard=True)
    aside = move_record_aside(tmp_path)
    assert (aside / "curves.png").is_file() and list((aside / "tensorboard").iterdir())
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "curves.png").exists()


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, tensorboard=True)  # steps 1-4 logged at 2 and 4; say it stopped after step 2
    cfg = LoggerConfig(progress="none", tensorboard=True)
    resumed = MetricsLogger(cfg, tmp_path, 4, 2, 2, name="t", config={})
    for step in (3, 4):
        resumed.train_step(record(step, loss=9.0))
    resumed.close({"steps": 4})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(2, 1.5), (4, 9.0)]


def test_a_language_models_curves_put_each_scale_on_an_axis_of_its_own() -> None:
    """Accuracy (0-1) and perplexity (75-175) on one linear axis made accuracy a flat line."""
    from giantpipe.metrics.curves import draw_curves, pyplot

    records = [{"kind": "train", "step": s, "loss": 5.0 - s / 100} for s in (10, 20, 30)]
    records += [
        {"kind": "eval", "step": 10, "loss": 5.2, "accuracy": 0.21, "perplexity": 175.0},
        {"kind": "eval", "step": 20, "loss": 4.8, "accuracy": 0.30, "perplexity": 120.0},
        {"kind": "eval", "step": 30, "loss": 4.3, "accuracy": 0.38, "perplexity": 75.0},
    ]
    fig = draw_curves(records)
    drawn = {
        ax.get_title(): {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        for ax in fig.axes
    }
    pyplot().close(fig)
    assert drawn == {
        "loss": {"train loss": [4.9, 4.8, 4.7], "eval loss": [5.2, 4.8, 4.3]},
        "accuracy": {"eval accuracy": [0.21, 0.30, 0.38]},
        "perplexity": {"eval perplexity": [175.0, 120.0, 75.0]},
    }
    accuracy = next(ax for ax in fig.axes if ax.get_title() == "accuracy")
    low, high = accuracy.get_ylim()
    assert 0.1 < low and high < 0.5  # the accuracy's own range, not perplexity's 75-175


def test_fractions_share_an_axis_and_a_run_without_evaluations_draws_the_loss_only() -> None:
    from giantpipe.metrics.curves import draw_curves, pyplot, scale_panels

    evals = [{"kind": "eval", "step": 4, "loss": 1.0, "accuracy": 0.5, "top5": 0.9, "bleu": 21.0}]
    assert scale_panels(evals) == [["accuracy", "top5"], ["bleu"]]
    fig = draw_curves([{"kind": "train", "step": 1, "loss": 2.0}])
    assert [ax.get_title() for ax in fig.axes] == ["loss"]
    pyplot().close(fig)


def test_the_sweep_plot_shows_values_as_they_are_and_equal_ones_equal() -> None:
    """Three jobs whose objective differs by float noise drew `1e-8+1.9411071` over the axis
    and three points far apart."""
    from giantpipe.metrics.curves import pyplot
    from giantpipe.metrics.sweep import draw_sweep

    values = [1.9411071, 1.94110711, 1.9411071]
    rows = [{"job": i, "pipeline.chunks": str(m), "status": "completed", "eval/loss": v}
            for i, (m, v) in enumerate(zip([1, 2, 4], values))]  # fmt: skip
    fig = draw_sweep(rows, ["pipeline.chunks"], "eval/loss")
    fig.canvas.draw()
    (ax,) = fig.axes
    offset = ax.yaxis.get_offset_text().get_text()
    ticks = [float(t.get_text().replace("\u2212", "-")) for t in ax.get_yticklabels()]
    heights = [ax.transData.transform((x, y))[1] for x, y in zip([1, 2, 4], values)]
    pyplot().close(fig)
    assert offset == ""
    assert min(ticks) > 1.9 and max(ticks) < 2.0  # the values themselves on the axis
    assert max(heights) - min(heights) < 0.5  # pixels: drawn equal
