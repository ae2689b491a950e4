"""Progress off a terminal: a line at every log_every step and at least one every
logger.progress_every_s seconds, through the log (the console and train.log); a bar on a
terminal instead."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from giantpipe.config import LoggerConfig
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.progress import ProgressLines, duration, wants_bar, wants_lines
from giantpipe.metrics.step import StepRecord


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(step: int, loss: float = 1.0) -> StepRecord:
    stats = SimpleNamespace(
        wall_time_s=0.5, span_s=0.5, busy_time_s=[0.1], recompute_time_s=[0.0], bubble=0.0,
        expected_bubble=0.0, peak_memory_bytes=[1], memory_kind="saved_activations",
        clock="perf_counter",
    )  # fmt: skip
    return StepRecord.from_engine(
        [stats], step=step, loss=loss, lr=0.1, step_time_s=0.5, samples=32, tokens=None
    )


def test_lines_come_at_every_log_step_and_after_every_s_seconds_between() -> None:
    clock = Clock()
    lines = ProgressLines(total=20, initial=0, every_s=30.0, clock=clock)
    said = {}
    for step in range(1, 21):
        clock.now += 12.0  # a 12 s step: 30 s pass within three steps
        said[step] = lines.add(step, loss=float(step), samples=32, step_time_s=12.0,
                               due=step % 10 == 0)  # fmt: skip
    # steps 3, 6, 9 by time (36 s since the last line), 10 by log_every, then 13, 16, 19, 20
    assert [s for s, line in said.items() if line] == [3, 6, 9, 10, 13, 16, 19, 20]
    assert said[3] == "step 3/20: loss 2.0000, 2.67 samples/s, ETA 3m 24s"
    assert said[10] == "step 10/20: loss 10.0000, 2.67 samples/s, ETA 2m 00s"


def test_a_step_longer_than_every_s_gets_a_line_of_its_own() -> None:
    clock = Clock()
    lines = ProgressLines(total=3, initial=0, every_s=30.0, clock=clock)
    clock.now += 45.0
    assert lines.add(1, loss=2.0, samples=8, step_time_s=45.0, due=False) == (
        "step 1/3: loss 2.0000, 0.178 samples/s, ETA 1m 30s"
    )


def test_progress_styles_choose_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch) -> None:
    for tty, bar, lines in ((True, True, False), (False, False, True)):
        monkeypatch.setattr(sys.stdout, "isatty", lambda tty=tty: tty)
        assert (wants_bar("auto"), wants_lines("auto")) == (bar, lines)
    assert (wants_bar("tqdm"), wants_lines("tqdm")) == (True, False)
    assert (wants_bar("lines"), wants_lines("lines")) == (False, True)
    assert (wants_bar("none"), wants_lines("none")) == (False, False)


def test_a_run_whose_stdout_is_no_terminal_logs_progress_lines(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)  # nohup, a cluster job
    clock = Clock()
    metrics = MetricsLogger(
        LoggerConfig(progress="auto", jsonl=False, progress_every_s=30.0), tmp_path,
        total_steps=8, start_step=0, log_every=4, name="t", config={}, clock=clock,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="giantpipe.metrics.logger"):
        for step in range(1, 9):
            clock.now += 29.0 if step == 6 else 1.0  # step 6 ends 30 s after step 4's line
            metrics.train_step(record(step))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(":")[0] for line in said] == ["step 4/8", "step 6/8", "step 8/8"]
    assert said[-1].endswith("ETA 0s")


def test_a_terminal_gets_the_bar_and_no_lines(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    metrics = MetricsLogger(
        LoggerConfig(progress="auto", jsonl=False), tmp_path, total_steps=2, start_step=0,
        log_every=1, name="t", config={},
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="giantpipe.metrics.logger"):
        metrics.train_step(record(1))
    metrics.bar.close()
    assert not [r for r in caplog.records if r.getMessage().startswith("step ")]


def test_progress_every_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="logger.progress_every_s"):
        LoggerConfig(progress_every_s=0.0)


def test_durations_read_as_people_read_them() -> None:
    assert [duration(s) for s in (0, 59.4, 60, 3599, 3600, 86399, 86400)] == [
        "0s", "59s", "1m 00s", "59m 59s", "1h 00m", "23h 59m", "1d 00h",
    ]  # fmt: skip
