"""The run's record in its directory, one rule for every executor.

Opening a record cuts ``metrics.jsonl`` back to the resumed step, saves the config and writes
the start line; closing it writes ``summary.json`` and the sinks (the figures; or the error and
the steps done, the error re-raised) and, on success, prints the table. Under torchrun only rank
0 holds one. What each file holds: docs/running.md#outputs; where the record goes and when a run
may write there: :mod:`giantpipe.runner.rundir`.

Example::

    metrics = open_record(cfg, run_dir, config_yaml, progress.step, resumed, parts.total_steps,
                          parts.spec, log)
    summary = run_to_summary(cfg.name, run_dir, metrics, loop.run, lambda: summarize(loop),
                             lambda: loop.progress.step)
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.engine.spec import PipelineSpec
from giantpipe.metrics.jsonl import truncate_after_step
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.summary import format_table, write_summary
from giantpipe.runner.planning import as_run
from giantpipe.runner.rundir import save_config

TRAIN_FIGURES = ("samples_per_s", "tokens_per_s", "step_time_s")
PIPELINE_FIGURES = (
    "bubble",
    "expected_bubble",
    "busy_time_s",
    "recompute_share",
    "stage_imbalance",
    "peak_memory_bytes",
    "memory_kind",
    "clock",
)


def open_record(
    cfg: ExperimentConfig,
    run_dir: Path,
    config_yaml: str,
    step: int,
    resumed: bool,
    total_steps: int,
    spec: PipelineSpec,
    log: logging.Logger,
    where: tuple[str, tuple[Any, ...]] = ("", ()),
    window: dict[str, Any] | None = None,
    plan_choice: dict[str, Any] | None = None,
) -> MetricsLogger:
    """Starts writing into ``run_dir`` (everything is checked by now); returns the sinks.

    ``spec`` is the pipeline as run (its devices, balance and M); ``log`` the runner's own
    logger; ``where`` a format and its arguments that the start line carries before the devices
    (the distributed runner's ranks); ``window`` the logging window the resumed checkpoint
    carries, whose partial line the resumed run replaces by the whole window's; ``plan_choice``
    the planner's, under plan=auto.
    """
    if resumed:
        cut = truncate_after_step(run_dir / "metrics.jsonl", step, partial_too=window is not None)
        if cut:
            log.info("metrics.jsonl cut back to step %d (%d lines after it, or torn)", step, cut)
    save_config(run_dir, config_yaml, step if resumed else None)
    log.info(
        "%s: " + where[0] + "devices %s, balance %s, M=%d, steps %d..%d, run dir %s",
        cfg.name,
        *where[1],
        list(spec.devices or ()),
        list(spec.balance),
        spec.chunks,
        step,
        total_steps,
        run_dir,
    )
    return MetricsLogger(
        cfg.logger,
        run_dir,
        total_steps,
        step,
        cfg.trainer.log_every,
        cfg.name,
        asdict(as_run(cfg, spec, plan_choice)),
        window=window,
    )


def base_summary(
    cfg: ExperimentConfig,
    spec: PipelineSpec,
    steps: int,
    wall_time_s: float,
    last_line: dict[str, Any] | None,
    evaluation: dict[str, Any],
    figures: dict[str, Any],
    pipeline: dict[str, Any],
) -> dict[str, Any]:
    """The figures both runners report, in summary.json's order; ``spec`` is the pipeline as run
    (its M), ``pipeline`` the runner's own ``pipeline/`` entries, which come before the chunks and
    the measured pipeline figures."""
    summary: dict[str, Any] = {
        "name": cfg.name,
        "status": "completed",
        "steps": steps,
        "wall_time_s": wall_time_s,
    }
    if last_line is not None:
        summary["train/loss"] = last_line["loss"]
    summary.update({f"eval/{k}": v for k, v in evaluation.items()})
    for key in TRAIN_FIGURES:
        if key in figures:
            summary[f"train/{key}"] = figures[key]
    summary.update(pipeline)
    summary["pipeline/chunks"] = spec.chunks
    for key in PIPELINE_FIGURES:
        if key in figures:
            summary[f"pipeline/{key}"] = figures[key]
    return summary


def run_to_summary(
    name: str,
    run_dir: Path,
    metrics: MetricsLogger | None,
    run: Callable[[], None],
    summarize: Callable[[], dict[str, Any]],
    steps: Callable[[], int],
) -> dict[str, Any]:
    """Runs ``run`` and closes the record with the summary of success or failure (re-raised)."""
    summary: dict[str, Any] = {"name": name, "status": "failed"}
    try:
        run()
        summary = summarize()
    except KeyboardInterrupt:
        summary.update(status="interrupted", steps=steps(), error="stopped by a second Ctrl-C")
        raise
    except Exception as err:
        summary.update(steps=steps(), error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if metrics is not None:
            _close(run_dir, metrics, summary)
    if metrics is not None:
        print(format_table(summary), flush=True)
    return summary


def _close(run_dir: Path, metrics: MetricsLogger, summary: dict[str, Any]) -> None:
    """Writes the summary and closes the sinks; on a full disk says so on stderr instead of
    hiding the error that ended the run."""
    try:
        write_summary(run_dir / "summary.json", summary)
        metrics.close(summary)
    except OSError as err:
        print(f"warning: {run_dir / 'summary.json'}: not written ({err.strerror})", file=sys.stderr)


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary.json a run wrote (None when there is none, or it is unreadable)."""
    try:
        summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary


def figures_of(cfg: ExperimentConfig, parts: Any) -> set[str]:
    """The numeric keys a completed run of ``parts`` puts in summary.json."""
    keys = {"steps", "wall_time_s", "train/loss", "eval/loss"}
    keys |= {f"train/{k}" for k in TRAIN_FIGURES if k != "tokens_per_s"}
    keys |= {f"pipeline/{k}" for k in ("bubble", "expected_bubble", "chunks", "world_size")}
    keys |= {"pipeline/recompute_share", "pipeline/stage_imbalance"}
    bundle = parts.bundle
    if bundle.metric in ("accuracy", "top5"):
        keys.add("eval/accuracy")
    if bundle.metric == "top5":
        keys.add("eval/top5")
    if bundle.tokens_per_batch is not None:
        keys.add("train/tokens_per_s")
    if bundle.loss == "cross_entropy" and bundle.tokens_per_batch is not None:
        keys.add("eval/perplexity")  # runner.evaluate.per_token
    if cfg.trainer.predict:
        keys |= {f"pipeline/{k}" for k in PREDICTED}
    return keys


PREDICTED = (
    "predicted_step_time_s",
    "predicted_bubble",
    "step_time_s",
    "step_time_vs_predicted",
    "predict_time_s",
)


def check_objective(cfg: ExperimentConfig, parts: Any) -> None:
    """sweep.objective names a figure this run will report (checked before it trains); the data's
    own evaluation (e.g. BLEU) may add ``eval/`` figures of its own."""
    key, known = cfg.sweep.objective, figures_of(cfg, parts)
    if key in known or (key.startswith("eval/") and parts.bundle.evaluate_model is not None):
        return
    raise ConfigError(
        "sweep.objective",
        f"{key!r} is not a figure this run reports; choose one of {', '.join(sorted(known))}",
    )
