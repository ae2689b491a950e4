"""Metrics: what an optimizer step reports and where it goes.

- ``record``: :class:`StepRecord` (one step's figures), :class:`Window` (their averages) and
  :class:`MetricsLogger`, the training loop's one door to the sinks;
- ``sinks``: the progress bar, ``metrics.jsonl``, W&B, ``summary.json`` and its table.

Imported by the runner (and scripts reading ``metrics.jsonl``); imports nothing of giantpipe
but ``giantpipe.config`` (the engine's step statistics are duck-typed, see ``record``).
"""
