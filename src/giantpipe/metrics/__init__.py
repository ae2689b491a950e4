"""Metrics: per-step records, windows over them, and sinks (progress bar, JSONL, W&B, summary).

The training loop talks to :class:`giantpipe.metrics.logger.MetricsLogger` only.
"""
