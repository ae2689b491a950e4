"""Metrics: what an optimizer step reports and where it goes.

    step.py       the step record: StepRecord, the Window that sums records, breakdown
    logger.py     the loop's door: MetricsLogger fans records out to the sinks, draws the curves
    progress.py   progress: a tqdm bar on a terminal, log lines elsewhere (nohup, clusters)
    jsonl.py      metrics.jsonl: its writer (JsonlSink), reader and resume trim
    trackers.py   the outside trackers: Weights & Biases and TensorBoard
    summary.py    the run's summary: labels, the two-column table, summary.json
    curves.py     curves.png: loss and evaluation figures against the step
    sweep.py      the sweep table: sweep.md, sweep.csv and sweep.png of a multirun

It imports nothing of giantpipe but ``giantpipe.config``, and matplotlib only to draw;
``write_sweep_table`` is importable from here for the command line's sweep callback.
"""

from __future__ import annotations

from giantpipe.metrics.sweep import write_sweep_table

__all__ = ["write_sweep_table"]
