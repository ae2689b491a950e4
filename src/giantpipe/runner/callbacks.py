"""Your own hooks into a run, named in the config: ``trainer.callbacks=[{_target_: ...}]``.

A callback is a class built from its ``_target_`` and the entry's other keys (as a model is)
that defines any of the hooks :data:`HOOKS` names; each gets the :class:`RunInfo` first. It runs
on rank 0 only, unless the class sets ``every_rank = True``. A hook that raises stops the run
at that step's end, on every rank, with one line naming the callback; the checkpoints are left
as the last save wrote them, and the run exits 1 (docs/running.md#callbacks).

Example::

    class Printer(Callback):                      # mypkg/callbacks.py
        def after_evaluation(self, run: RunInfo, figures: dict[str, float]) -> None:
            print(run.step, figures["eval/loss"])

    # python train.py 'trainer.callbacks=[{_target_: mypkg.callbacks.Printer}]'
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from giantpipe.config import ConfigError
from giantpipe.metrics.step import StepRecord
from giantpipe.runner.registry import build_from_target, locate
from giantpipe.runner.world import World

HOOKS = ("after_step", "after_evaluation", "after_save", "at_end")
"""The hooks, in the order a run calls them: after each optimizer step; after each evaluation;
after each checkpoint is committed (``step_N/`` or ``last/``); once the run has ended without
failing (completed, stopped early, or stopped by a signal after saving)."""


@dataclass(frozen=True)
class RunInfo:
    """Where the run is, for a hook."""

    name: str
    run_dir: Path
    step: int
    """Optimizer steps done (``after_save``: the step the checkpoint holds; with
    trainer.async_save the hook comes once the write is committed, a few steps later)."""
    total_steps: int
    rank: int
    world_size: int


class Callback:
    """A base to subclass (optional: any class defining one of the hooks will do). Every
    hook does nothing until overridden."""

    every_rank: bool = False
    """Call the hooks on every torchrun rank (False: on rank 0 only)."""

    def after_step(self, run: RunInfo, figures: dict[str, float]) -> None:
        """After each optimizer step: ``train/loss``, ``train/lr``, ``train/step_time_s``,
        ``train/samples`` (and ``train/grad_norm`` when clipping)."""

    def after_evaluation(self, run: RunInfo, figures: dict[str, float]) -> None:
        """After each evaluation: its figures, e.g. ``eval/loss``, ``eval/accuracy``."""

    def after_save(self, run: RunInfo, directory: Path) -> None:
        """After a checkpoint is committed: ``directory`` is ``RUN/step_N`` or ``RUN/last``."""

    def at_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        """Once the run has ended without failing: the summary (rank 0's, on every rank)."""


class CallbackError(RuntimeError):
    """A callback's hook raised; the run stopped after the step (one line names it)."""


@dataclass(frozen=True)
class Named:
    """A callback built on this process, and how error lines name it."""

    label: str
    """``trainer.callbacks[0] (mypkg.MyCallback)``."""
    callback: Any


def build_callbacks(specs: list[dict[str, Any]], world: World) -> Callbacks:
    """Builds ``trainer.callbacks`` on the ranks that call them (a ConfigError names the
    entry: a target that does not import, arguments that do not fit it, no hook defined).

    Example::

        callbacks = build_callbacks([{"_target_": "mypkg.MyCallback", "every": 2}], World())
    """
    built = []
    for index, spec in enumerate(specs):
        key = f"trainer.callbacks[{index}]"
        target = locate(str(spec.get("_target_", "")), f"{key}._target_")
        every = getattr(target, "every_rank", False)
        if not isinstance(every, bool):
            raise ConfigError(key, f"every_rank must be True or False, got {every!r}")
        if world.rank != 0 and not every:
            continue
        callback = build_from_target(spec, key)
        check_hooks(callback, key)
        built.append(Named(f"{key} ({spec['_target_']})", callback))
    return Callbacks(built, bool(specs))


def check_hooks(callback: Any, key: str) -> None:
    """A callback defines a hook, and no method whose name looks like a misspelt one."""
    methods = [n for n, _ in inspect.getmembers(callback, callable) if not n.startswith("_")]
    for name in methods:
        if name.startswith(("after_", "at_", "on_", "before_")) and name not in HOOKS:
            near = difflib.get_close_matches(name, HOOKS, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ConfigError(key, f"{name} is not a hook ({hint}the hooks are {', '.join(HOOKS)})")
    if not any(name in methods for name in HOOKS):
        raise ConfigError(key, f"{type(callback).__name__} defines none of {', '.join(HOOKS)}")


class Callbacks:
    """This process's callbacks: calls their hooks and remembers the first that raised."""

    def __init__(self, built: list[Named], configured: bool) -> None:
        self.built = built
        self.configured = configured
        """Whether trainer.callbacks names any (on every rank alike: then failures are agreed)."""
        self.failure: str | None = None
        """The line of the first hook that raised."""
        self.error: Exception | None = None
        """What it raised."""

    def call(self, hook: str, run: RunInfo, *args: Any) -> None:
        """Calls ``hook`` of every callback that defines it; none after one has raised."""
        for named in self.built:
            method = getattr(named.callback, hook, None)
            if self.failure is not None or method is None:
                continue
            try:
                method(run, *args)
            except Exception as err:  # noqa: BLE001 - one line, then the run stops
                on_rank = f" on rank {run.rank}" if run.world_size > 1 else ""
                self.failure = (
                    f"{named.label} failed in {hook} at step {run.step}{on_rank}: "
                    f"{type(err).__name__}: {err}"
                )
                self.error = err

    def agreed_failure(self, world: World) -> str | None:
        """The first failure on any rank, on every rank (collective when configured)."""
        if not self.configured or world.size == 1:
            return self.failure
        if not world.sum([float(self.failure is not None)])[0]:
            return None
        return next(line for line in world.gather(self.failure) if line is not None)


def step_figures(record: StepRecord) -> dict[str, float]:
    """What ``after_step`` gets of a step's record."""
    figures = {
        "train/loss": record.loss,
        "train/lr": record.lr,
        "train/step_time_s": record.step_time_s,
        "train/samples": float(record.samples),
    }
    if record.grad_norm is not None:
        figures["train/grad_norm"] = record.grad_norm
    return figures
