"""The length of training, evaluation, saving and resumption: the ``trainer`` group's schema.

Example::

    from giantpipe.config import TrainerConfig

    TrainerConfig(max_steps=None, max_epochs=3.0, eval_every=100, resume="auto")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from giantpipe.config.checks import (
    ConfigError,
    check,
    check_choice,
    check_fields_finite,
    check_min,
    check_optional_path,
)
from giantpipe.config.sweep import SweepConfig

SAVE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGCONT")
MONITOR_MODES = ("min", "max")
RESUME_AUTO = "auto"
"""``trainer.resume=auto``: resume where a checkpoint exists, start where none, skip a finished
run (see giantpipe.runner.rundir.resume_point)."""
RESUME_CHECKED = ("trainer.seed", "model", "data")
"""What a resume may not change unless ``trainer.resume_changed`` says the change is meant: the
seed of the batch order, and every key of the model and the data (see
giantpipe.runner.rundir.check_resumed_config)."""


@dataclass
class TrainerConfig:
    """Length of training, evaluation, checkpoints, regularization and resumption."""

    max_steps: int | None = 100
    """Optimizer steps to train for (or set max_epochs and make this null)."""
    max_epochs: float | None = None
    """Epochs to train for; converted with the data's steps per epoch."""
    accumulate: int = 1
    """Engine steps (batches) per optimizer step; grads equal those of the combined batch."""
    eval_every: int = 50
    """Evaluate every N optimizer steps (0: only at the end)."""
    eval_batches: int | None = None
    """Evaluate on the first N eval batches (null: all)."""
    log_every: int = 10
    """Write a metrics line every N optimizer steps."""
    checkpoint_every: int = 0
    """Also keep ``step_N.pt`` every N steps (0: only ``last.pt``)."""
    save_last: bool = True
    """Write ``last.pt`` at every evaluation and at the end."""
    async_save: bool = False
    """Write checkpoints in a background thread: the step waits only for the copy of the state
    to host memory; the next save, and the end of the run, wait for the write (whose failure
    is reported there)."""
    resume: Any = False
    """false; true (``last/`` in the run directory); ``auto`` (resume where the run directory
    holds a checkpoint, start where it holds none, skip a run that completed: one command
    restarts a killed sweep); or a path to a checkpoint (a directory, or a ``.pt`` file of the
    earlier format)."""
    resume_changed: list[str] = field(default_factory=list)
    """What a resume may change on purpose among the keys it checks against the saved run's
    config (``trainer.seed`` and every ``model.*`` and ``data.*`` key), e.g. ``[trainer.seed]``,
    ``[data.root]`` or a whole group, ``[data]``. Anything else (steps, evaluation, the LR
    schedule's length, the pipeline's shape) may change freely."""
    seed: int = 0
    """Seeds python, numpy (if present) and torch, and the order of training batches."""
    grad_clip: float | None = None
    """Clip gradients to this global norm across all stages (null: no clipping)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights with this decay; evaluate with it."""
    init_from: str | None = None
    """Fine-tune: start from this checkpoint's weights (its EMA when it kept one), loading every
    tensor whose name and shape match; the rest (a classifier for another number of classes)
    keep their fresh initialization. Optimizer, step and data position start anew. Ignored when
    resuming (trainer.resume), which restores the run's own checkpoint."""
    predict: bool = True
    """After the first step, profile the stages once and log the simulator's predicted step
    time, bubble and peak memory beside the measured ones (summary: pipeline/predicted_*).
    Under torchrun: after the second step, from every rank's timings of it."""
    trace_steps: list[int] = field(default_factory=list)
    """Optimizer steps to write as Chrome / Perfetto traces, ``trace-stepN.json`` in the run
    directory (e.g. ``[5]``): one track per stage (per rank under torchrun) with forward,
    backward, recompute, wait, send and receive, beside the simulated step once
    trainer.predict has made it (docs/profiling.md). A step past the run's end is refused."""
    save_signal: str | None = None
    """A signal that saves a checkpoint at the next step boundary and goes on, e.g. ``SIGUSR1``
    (SLURM: ``--signal=USR1@120``). SIGTERM always saves and stops (exit 143), SIGHUP (a dropped
    terminal) too (exit 129) unless it is the save signal, Ctrl-C stops (exit 130)."""
    overwrite: bool = False
    """A fresh run into a directory holding another run's record (metrics, summary) but no
    checkpoint: true moves that record aside (``replaced-N/``) and starts over; false refuses."""
    keep_last: int | None = None
    """Of the ``step_N/`` that trainer.checkpoint_every writes, keep the K newest (null: all)."""
    keep_best: int = 0
    """Keep the K best ``step_N/`` by trainer.monitor, saving evaluations that rank (0: none)."""
    monitor: str | None = None
    """The eval figure keep_best and early stopping watch (null: sweep.objective, eval/loss)."""
    monitor_mode: str | None = None
    """``min`` or ``max``: which way trainer.monitor improves (null: sweep.direction)."""
    early_stop_patience: int | None = None
    """Stop (exit 0) after this many evaluations without trainer.monitor improving (null: no)."""
    early_stop_min_delta: float = 0.0
    """The least change of trainer.monitor that counts as an improvement."""
    callbacks: list[Any] = field(default_factory=list)
    """Your hooks: ``[{_target_: mypkg.MyCallback}]`` (the protocol: giantpipe.runner.callbacks)."""

    def __post_init__(self) -> None:
        check_fields_finite(self, "trainer")
        check_optional_path(self.init_from, "trainer.init_from")
        check(
            (self.max_steps is None) != (self.max_epochs is None),
            "trainer.max_steps",
            "set exactly one of trainer.max_steps or trainer.max_epochs (make the other null)",
        )
        if self.max_steps is not None:
            check_min(self.max_steps, 1, "trainer.max_steps")
        if self.max_epochs is not None:
            check(self.max_epochs > 0, "trainer.max_epochs", f"must be > 0, got {self.max_epochs}")
        check_min(self.accumulate, 1, "trainer.accumulate")
        check_min(self.eval_every, 0, "trainer.eval_every")
        if self.eval_batches is not None:
            check_min(self.eval_batches, 1, "trainer.eval_batches")
        check_min(self.log_every, 1, "trainer.log_every")
        check_min(self.checkpoint_every, 0, "trainer.checkpoint_every")
        check(
            isinstance(self.trace_steps, list | tuple)
            and all(isinstance(n, int) and n >= 1 for n in self.trace_steps),
            "trainer.trace_steps",
            f"must be a list of optimizer steps (>= 1), e.g. [5]; got {self.trace_steps!r}",
        )
        if self.max_steps is not None:
            check_trace_steps(self.trace_steps, self.max_steps)
        check(
            isinstance(self.resume, bool | str) and self.resume != "",
            "trainer.resume",
            f"must be true, false, auto or a checkpoint path; got {self.resume!r}",
        )
        self._check_resume_changed()
        if self.grad_clip is not None:
            check(self.grad_clip > 0, "trainer.grad_clip", f"must be > 0, got {self.grad_clip}")
        check(
            0.0 <= self.label_smoothing < 1.0,
            "trainer.label_smoothing",
            f"must be in [0, 1), got {self.label_smoothing}",
        )
        if self.ema_decay is not None:
            check(
                0.0 < self.ema_decay < 1.0,
                "trainer.ema_decay",
                f"must be in (0, 1), got {self.ema_decay}",
            )
        check(
            isinstance(self.seed, int) and 0 <= self.seed < 2**64,
            "trainer.seed",
            f"must be an integer in [0, 2**64), got {self.seed}",
        )
        if self.save_signal is not None:
            check_choice(self.save_signal, SAVE_SIGNALS, "trainer.save_signal")
        self._check_keeping()
        check_callbacks(self.callbacks)

    def _check_keeping(self) -> None:
        """keep_last, keep_best, the monitor and early stopping: each needs what it watches."""
        if self.keep_last is not None:
            check_min(self.keep_last, 1, "trainer.keep_last")
            check(
                self.checkpoint_every > 0,
                "trainer.keep_last",
                "keeps the newest step_N/ that trainer.checkpoint_every writes, and that is 0 "
                "(none are written); set trainer.checkpoint_every",
            )
        check_min(self.keep_best, 0, "trainer.keep_best")
        if self.monitor is not None:
            check(
                isinstance(self.monitor, str) and self.monitor.startswith("eval/"),
                "trainer.monitor",
                f"must name an eval figure, e.g. eval/loss or eval/accuracy; got {self.monitor!r}",
            )
        if self.monitor_mode is not None:
            check_choice(self.monitor_mode, MONITOR_MODES, "trainer.monitor_mode")
        if self.early_stop_patience is not None:
            check_min(self.early_stop_patience, 1, "trainer.early_stop_patience")
            check(
                self.eval_every > 0,
                "trainer.early_stop_patience",
                "counts the evaluations every trainer.eval_every steps, and that is 0 (only the "
                "final one); set trainer.eval_every",
            )
        check_min(self.early_stop_min_delta, 0.0, "trainer.early_stop_min_delta")

    def _check_resume_changed(self) -> None:
        entries = self.resume_changed
        check(
            isinstance(entries, list | tuple) and all(isinstance(e, str) for e in entries),
            "trainer.resume_changed",
            f"must be a list of keys, e.g. [trainer.seed]; got {entries!r}",
        )
        for entry in entries:
            checked = any(entry == k or entry.startswith(k + ".") for k in RESUME_CHECKED)
            check(
                checked,
                "trainer.resume_changed",
                f"{entry} is not checked on resume (only trainer.seed, model.* and data.* are); "
                "other keys may change without it",
            )


def check_callbacks(callbacks: Any) -> None:
    """``trainer.callbacks`` is a list of ``_target_`` specs (whether each imports and fits its
    class is checked when the run builds them: giantpipe.runner.callbacks).

    Example::

        check_callbacks([{"every": 2}])
        # ConfigError: trainer.callbacks[0]._target_: missing: name your callback's class, e.g.
        # {_target_: mypkg.MyCallback}
    """
    check(
        isinstance(callbacks, list | tuple),
        "trainer.callbacks",
        f"must be a list, e.g. [{{_target_: mypkg.MyCallback}}]; got {callbacks!r}",
    )
    for index, spec in enumerate(callbacks):
        key = f"trainer.callbacks[{index}]"
        check(
            isinstance(spec, dict),
            key,
            f"must be a mapping with a _target_, e.g. {{_target_: mypkg.MyCallback}}; got {spec!r}",
        )
        target = spec.get("_target_")
        check(
            isinstance(target, str) and "." in target,
            f"{key}._target_",
            "missing: name your callback's class, e.g. {_target_: mypkg.MyCallback}"
            if target is None
            else f"must be a dotted path like mypkg.MyCallback; got {target!r}",
        )


def monitored(trainer: TrainerConfig, sweep: SweepConfig) -> tuple[str, str]:
    """The eval figure keep_best and early stopping watch, and which way it improves
    (``min`` or ``max``): trainer.monitor, else sweep.objective with sweep.direction.

    Example::

        monitored(TrainerConfig(keep_best=1), SweepConfig())      # ("eval/loss", "min")
        monitored(TrainerConfig(monitor="eval/accuracy", monitor_mode="max"), SweepConfig())
        # ("eval/accuracy", "max")
    """
    key = trainer.monitor or sweep.objective
    if trainer.monitor_mode is not None:
        mode = trainer.monitor_mode
    elif key == sweep.objective:
        mode = "min" if sweep.direction == "minimize" else "max"
    else:
        raise ConfigError(
            "trainer.monitor_mode",
            f"say which way {key} improves: trainer.monitor_mode=min or trainer.monitor_mode=max",
        )
    check(
        key.startswith("eval/"),
        "trainer.monitor",
        f"keep_best and early stopping watch an eval figure, and sweep.objective is {key!r}; "
        "set trainer.monitor, e.g. trainer.monitor=eval/loss",
    )
    return key, mode


def check_trace_steps(trace_steps: list[int], total_steps: int) -> None:
    """``trainer.trace_steps`` past the run's last step would never be written: refused at the
    start (the runner checks it again against the steps ``trainer.max_epochs`` gives).

    Example::

        check_trace_steps([50], 5)
        # ConfigError: trainer.trace_steps: [50] is past the run's end (it trains 5 optimizer
        # steps), so nothing would be traced; choose steps from 1 to 5
    """
    late = sorted(n for n in trace_steps if n > total_steps)
    check(
        not late,
        "trainer.trace_steps",
        f"{late} is past the run's end (it trains {total_steps} optimizer steps), so nothing "
        f"would be traced; choose steps from 1 to {total_steps}",
    )
