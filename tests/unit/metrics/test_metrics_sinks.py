"""Metrics: records, windows, JSONL, summary table, quiet progress bar off a terminal."""

import json
from types import SimpleNamespace

import pytest

from giantpipe.config import LoggerConfig
from giantpipe.metrics.jsonl import JsonlSink, read_jsonl, truncate_after_step
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.progress import wants_bar
from giantpipe.metrics.step import StepRecord, Window, breakdown
from giantpipe.metrics.summary import format_table, write_summary


def stats(busy, peak, bubble=0.25, recompute=None, span=1.0):
    return SimpleNamespace(
        wall_time_s=1.0,
        span_s=span,
        busy_time_s=busy,
        recompute_time_s=recompute if recompute is not None else [0.0] * len(busy),
        bubble=bubble,
        expected_bubble=0.2,
        peak_memory_bytes=peak,
        memory_kind="saved_activations",
        clock="perf_counter",
    )


def record(step: int, loss: float, time_s: float = 0.5, tokens=None) -> StepRecord:
    return StepRecord.from_engine(
        [stats([0.1, 0.2], [10, 20])],
        step=step,
        loss=loss,
        lr=0.1,
        step_time_s=time_s,
        samples=32,
        tokens=tokens,
    )


def test_from_engine_merges_accumulated_engine_steps():
    r = StepRecord.from_engine(
        [stats([0.1, 0.2], [10, 50], 0.2), stats([0.3, 0.4], [30, 20], 0.4)],
        step=1,
        loss=1.0,
        lr=0.1,
        step_time_s=1.0,
        samples=8,
        tokens=None,
    )
    assert r.busy_time_s == pytest.approx([0.4, 0.6])
    assert r.peak_memory_bytes == [30, 50]
    assert r.bubble == pytest.approx(0.3)


def test_window_figures():
    w = Window()
    w.add(record(1, 2.0, 0.5, tokens=100))
    w.add(record(2, 1.0, 1.5, tokens=300))
    f = w.figures()
    assert f["loss"] == 1.5
    assert f["samples_per_s"] == pytest.approx(64 / 2.0)
    assert f["tokens_per_s"] == pytest.approx(400 / 2.0)
    assert f["step_time_s"] == 1.0
    assert f["busy_time_s"] == pytest.approx([0.1, 0.2])
    assert f["peak_memory_bytes"] == [10, 20]


def test_breakdown_is_recompute_over_the_stage_timelines_and_busiest_over_mean():
    # K=2 stages over a 2 s span: 4 s of timeline, 0.5 + 0.3 s of it re-materializing.
    figures = breakdown([1.5, 1.0], [0.5, 0.3], span=2.0)
    assert figures["recompute_share"] == pytest.approx(0.8 / 4.0)
    assert figures["stage_imbalance"] == pytest.approx(1.5 / 1.25 - 1)
    assert breakdown([], [], span=0.0) == {"recompute_share": 0.0, "stage_imbalance": 0.0}


def test_window_reports_the_breakdown_over_its_steps():
    # Two optimizer steps, the first of two engine steps (gradient accumulation): every sum
    # runs over all three engine steps, so the figures are those of their totals.
    first = StepRecord.from_engine(
        [stats([0.4, 0.2], [1, 1], recompute=[0.1, 0.0], span=0.5),
         stats([0.4, 0.2], [1, 1], recompute=[0.1, 0.1], span=0.5)],
        step=1, loss=1.0, lr=0.1, step_time_s=1.0, samples=8, tokens=None,
    )  # fmt: skip
    assert first.recompute_time_s == pytest.approx([0.2, 0.1]) and first.span_s == 1.0
    second = StepRecord.from_engine(
        [stats([0.6, 0.6], [1, 1], recompute=[0.3, 0.2], span=1.0)],
        step=2, loss=1.0, lr=0.1, step_time_s=1.0, samples=8, tokens=None,
    )  # fmt: skip
    w = Window()
    w.add(first)
    w.add(second)
    f = w.figures()
    # busy [1.4, 1.0], recompute [0.5, 0.3], span 2.0 over K=2 stages
    assert f["recompute_share"] == pytest.approx(0.8 / 4.0)
    assert f["stage_imbalance"] == pytest.approx(1.4 / 1.2 - 1)
    assert f["bubble"] == pytest.approx(0.25) and f["expected_bubble"] == 0.2


def test_jsonl_lines_are_valid_json_even_for_nan(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write({"step": 1, "loss": float("nan"), "busy": [1.0, float("inf")]})
    sink.write({"step": 2, "loss": 1.0})
    sink.close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    truncate_after_step(tmp_path / "m.jsonl", 1)
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [1]


def test_logger_writes_a_line_every_log_step_and_flushes_the_rest(tmp_path):
    cfg = LoggerConfig(progress="none")
    metrics = MetricsLogger(
        cfg, tmp_path, total_steps=5, start_step=0, log_every=2, name="t", config={}
    )
    lines = [metrics.train_step(record(s, 1.0 / s)) for s in range(1, 6)]
    assert [line["step"] if line else None for line in lines] == [None, 2, None, 4, None]
    assert metrics.flush()["step"] == 5
    metrics.evaluation(5, {"loss": 0.5})
    metrics.close({})
    kinds = [(r["kind"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert kinds == [("train", 2), ("train", 4), ("train", 5), ("eval", 5)]
    # The first step (start-up) is left out of the run-long throughput.
    assert metrics.run_figures()["samples_per_s"] == pytest.approx(4 * 32 / 2.0)


def test_summary_table_and_json(tmp_path):
    summary = {
        "name": "x",
        "steps": 5,
        "eval/loss": 0.5,
        "pipeline/peak_memory_bytes": [2048, 10],
        "train/loss": float("nan"),
    }
    table = format_table(summary)
    assert "eval loss" in table and "2.0 KiB, 10 B" in table
    write_summary(tmp_path / "summary.json", summary)
    assert json.loads((tmp_path / "summary.json").read_text())["train/loss"] == "nan"


def test_the_summary_table_says_what_retention_kept_and_why_the_run_stopped() -> None:
    summary = {
        "steps": 30,
        "stopped_early": "eval/loss has not improved by 0.01 for 2 evaluations",
        "checkpoints/kept": {"step_10": "best", "step_30": "last 1"},
        "checkpoints/removed": 2,
    }
    lines = format_table(summary).splitlines()[1:-1]
    assert [line.split("  ")[0].strip() for line in lines] == [
        "optimizer steps",
        "stopped early",
        "checkpoint kept: step_10",
        "checkpoint kept: step_30",
        "checkpoints removed",
    ]


def test_progress_bar_is_quiet_off_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert not wants_bar("auto")
    assert wants_bar("tqdm") and not wants_bar("none")


def test_a_resumed_run_writes_the_lines_of_the_uninterrupted_one(tmp_path):
    """A stop after step 7 (log_every=5) writes the window 6-7 as a partial line and leaves the
    window to the checkpoint; the resumed run replaces the line by the whole window 6-10."""
    cfg = LoggerConfig(progress="none")
    loss = {s: 1.0 / s for s in range(1, 13)}

    def logger(folder, start, window=None):
        return MetricsLogger(cfg, folder, 12, start, 5, name="t", config={}, window=window)

    (tmp_path / "whole").mkdir()
    whole = logger(tmp_path / "whole", 0)
    for step in range(1, 13):
        whole.train_step(record(step, loss[step]))
    whole.flush()
    whole.close({})
    (tmp_path / "cut").mkdir()
    first = logger(tmp_path / "cut", 0)
    for step in range(1, 8):
        first.train_step(record(step, loss[step]))
    first.flush()
    carried = json.loads(json.dumps(first.window_state()))  # as the checkpoint's manifest holds it
    first.close({})
    assert [r.get("partial", False) for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl")] == [
        False, True,
    ]  # fmt: skip
    truncate_after_step(tmp_path / "cut" / "metrics.jsonl", 7, partial_too=carried is not None)
    resumed = logger(tmp_path / "cut", 7, window=carried)
    for step in range(8, 13):
        resumed.train_step(record(step, loss[step]))
    resumed.flush()
    resumed.close({})
    lines = [read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("whole", "cut")]
    assert [r["step"] for r in lines[0]] == [5, 10, 12]
    assert lines[1] == lines[0]
