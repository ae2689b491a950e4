"""The run directory and the run's record in it, one rule for every executor.

Where a run starts or resumes, decided before anything is written: a fresh run refuses a
directory that already holds a checkpoint (it would overwrite it); a resume needs one
(``last/``, or a ``last.pt`` of the earlier format). Then the record: opening cuts
``metrics.jsonl`` back to the resumed step, saves ``config.yaml`` and writes one start line in
the log; closing writes the summary (the figures on success; the error and the steps done on
failure, which is re-raised) to ``summary.json`` and the sinks, and on success prints the
table. Under torchrun only rank 0 holds a record (``metrics`` is None elsewhere).

Example::

    checkpoint = resume_point(cfg.trainer.resume, run_dir)   # None for a fresh run
    metrics = open_record(cfg, run_dir, config_yaml, progress.step, resumed, parts.total_steps,
                          parts.devices, parts.balance, log)
    summary = run_to_summary(
        cfg.name, run_dir, metrics, loop.run, lambda: summarize(loop), lambda: loop.progress.step
    )
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from giantpipe.config import ConfigError, ExperimentConfig
from giantpipe.engine.dist.shards import MANIFEST
from giantpipe.metrics.logger import MetricsLogger
from giantpipe.metrics.sinks import format_table, truncate_after_step, write_summary

LAST = "last"
"""The checkpoint directory refreshed at every evaluation and at the end."""
LEGACY_LAST = "last.pt"
"""The same, as the earlier one-file format wrote it."""
KEY = "trainer.resume"


def held_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``run_dir`` holds, if any: ``last/`` or a legacy ``last.pt``."""
    if (run_dir / LAST / MANIFEST).is_file():
        return run_dir / LAST
    if (run_dir / LEGACY_LAST).exists():
        return run_dir / LEGACY_LAST
    return None


def _shown(path: Path, run_dir: Path) -> str:
    name = path.relative_to(run_dir)
    return f"{name}/{MANIFEST}" if path.is_dir() else str(name)


def resume_point(resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from (a directory, or a ``.pt`` of the earlier format), or None
    for a fresh run; ConfigError when the request cannot be met.

    Example::

        resume_point(True, Path("outputs/2024-05-01/10-00-00"))   # .../last
    """
    held = held_checkpoint(run_dir)
    if resume is False:
        if held is not None:
            raise ConfigError(
                KEY,
                f"{run_dir} already holds a run ({_shown(held, run_dir)}); pass "
                "trainer.resume=true to continue it, or choose another hydra.run.dir",
            )
        return None
    if resume is True:
        if held is None:
            raise ConfigError(KEY, f"no checkpoint at {run_dir / LAST}")
        return held
    path = Path(str(resume)).expanduser()
    if path.name == MANIFEST:
        path = path.parent
    if not (path.is_file() or (path / MANIFEST).is_file()):
        raise ConfigError(KEY, f"no checkpoint at {path}")
    if held is not None and not held.samefile(path):
        raise ConfigError(
            KEY,
            f"{run_dir} holds another run's {_shown(held, run_dir)}; resume from a checkpoint "
            "into a new directory",
        )
    return path


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` if needed; ConfigError naming it unless the run can write there."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError("hydra.run.dir", f"cannot create {run_dir} ({err.strerror})") from err
    if not os.access(run_dir, os.W_OK):
        raise ConfigError("hydra.run.dir", f"cannot write to {run_dir}")


def save_config(run_dir: Path, config_yaml: str, resumed_at: int | None) -> Path:
    """Write the resolved config: ``config.yaml``, or ``config.resume_<step>.yaml`` on a resume
    (the original stays as it was)."""
    name = "config.yaml" if resumed_at is None else f"config.resume_{resumed_at}.yaml"
    path = run_dir / name
    path.write_text(config_yaml)
    return path


TRAIN_FIGURES = ("samples_per_s", "tokens_per_s", "step_time_s")
PIPELINE_FIGURES = ("bubble", "expected_bubble", "busy_time_s", "peak_memory_bytes", "memory_kind")


def open_record(
    cfg: ExperimentConfig,
    run_dir: Path,
    config_yaml: str,
    step: int,
    resumed: bool,
    total_steps: int,
    devices: Sequence[Any],
    balance: Sequence[int],
    log: logging.Logger,
    where: tuple[str, tuple[Any, ...]] = ("", ()),
) -> MetricsLogger:
    """Starts writing into ``run_dir`` (everything is checked by now); returns the sinks.

    ``log`` is the runner's own logger; ``where`` a format and its arguments that the start
    line carries before the devices (the distributed runner's ranks).
    """
    if resumed:
        truncate_after_step(run_dir / "metrics.jsonl", step)
    save_config(run_dir, config_yaml, step if resumed else None)
    log.info(
        "%s: " + where[0] + "devices %s, balance %s, M=%d, steps %d..%d, run dir %s",
        cfg.name,
        *where[1],
        devices,
        balance,
        cfg.pipeline.chunks,
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
        asdict(cfg),
    )


def base_summary(
    cfg: ExperimentConfig,
    steps: int,
    wall_time_s: float,
    last_line: dict[str, Any] | None,
    evaluation: dict[str, Any],
    figures: dict[str, Any],
    pipeline: dict[str, Any],
) -> dict[str, Any]:
    """The figures both runners report, in summary.json's order; ``pipeline`` holds the runner's
    own ``pipeline/`` entries, which come before the chunks and the measured pipeline figures."""
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
    summary["pipeline/chunks"] = cfg.pipeline.chunks
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
    except Exception as err:
        summary.update(steps=steps(), error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if metrics is not None:
            write_summary(run_dir / "summary.json", summary)
            metrics.close(summary)
    if metrics is not None:
        print(format_table(summary), flush=True)
    return summary


class Checkpointing(Protocol):
    """What :func:`after_step` needs of a training loop (both runners' loops have it)."""

    cfg: ExperimentConfig
    progress: Any
    parts: Any

    def evaluate(self) -> None: ...

    def save(self, name: str) -> None: ...


def after_step(loop: Checkpointing, last: str, numbered: Callable[[int], str]) -> None:
    """The cadence after each optimizer step, one rule for the local and distributed loops.

    Every ``trainer.eval_every`` steps before the end: evaluate, then refresh ``last`` (with
    ``trainer.save_last``); every ``trainer.checkpoint_every`` steps: write ``numbered(step)``
    and ``last``. The runners differ only in names (``last.pt`` files, ``last/`` shard dirs).

    Example::

        after_step(self, LAST, lambda step: f"step_{step}.pt")
    """
    trainer, step = loop.cfg.trainer, loop.progress.step
    if trainer.eval_every and step % trainer.eval_every == 0 and step < loop.parts.total_steps:
        loop.evaluate()
        if trainer.save_last:
            loop.save(last)
    if trainer.checkpoint_every and step % trainer.checkpoint_every == 0:
        loop.save(numbered(step))
        loop.save(last)
