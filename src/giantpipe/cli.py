"""The entry point's side of Hydra: register the schemas, convert the config once, run a job,
condense errors.

``train.py`` is a thin ``@hydra.main``; this module is the only one that touches Hydra and
OmegaConf. :func:`register_configs` stores the schemas in Hydra's ConfigStore: the core groups'
(``giantpipe.config``) and, found from ``conf/``, those of the ``model`` and ``data`` options,
which live beside their builders. :func:`to_experiment` turns the composed config into
:class:`giantpipe.config.ExperimentConfig` (validating every group in ``__post_init__``); the job
runs the training and hands Hydra the sweep objective.

How an option finds its schema (adding a model or a data set edits no list): an option file
``conf/GROUP/NAME.yaml`` names its builder by ``_target_`` and, first in its defaults, a
dataclass of the builder's module::

    # conf/model/mlp.yaml                      # models/mlp.py
    defaults:                                  def mlp(in_features=16, ...) -> nn.Sequential
      - MlpModelConfig                         @dataclass
      - _self_                                 class MlpModelConfig:
    _target_: models.mlp.mlp                       _target_: str = "models.mlp.mlp"
    hidden: 64                                     in_features: int = 16 ...

Errors become ONE line on stderr that names the key or path, and a non-zero exit:

    $ python train.py trainer.foo=1
    error: trainer.foo: unknown key (Key 'foo' not in 'TrainerConfig')

A multirun ends with ``sweep.md`` / ``sweep.csv`` / ``sweep.png`` in its sweep directory: each
job's swept overrides against ``sweep.objective`` (:class:`SweepTable`, a Hydra callback that
conf/config.yaml names under ``hydra.callbacks``).

Set HYDRA_FULL_ERROR=1 for the full traceback. In a multirun a failing job is logged, returns
NaN (sweepers such as Optuna mark the trial failed) and the other jobs go on. A refused config
leaves the disk as it was: the run directory Hydra made for the job (and its empty log) goes.

A run stopped by a signal exits with a documented status after saving: SIGTERM (a cluster
preempting the job) 143, SIGHUP (the terminal or SSH session went away) 129, Ctrl-C 130 (a
second Ctrl-C stops at once, also 130); the remaining jobs of a multirun are not started.

Under torchrun (``pipeline.executor=distributed``) every rank composes the config, but only
rank 0 keeps Hydra's run directory and log file: the other ranks log warnings to stderr and
learn the run directory from rank 0 (see :func:`rank_overrides`).

Example (train.py)::

    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    def main(cfg: DictConfig) -> float:
        return run_job(cfg)

    if __name__ == "__main__":
        guarded(main, conf_dir=Path(__file__).parent / "conf")   # registers, then runs
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from giantpipe.config import RENAMED_KEYS, ConfigError, ExperimentConfig, check_finite

log = logging.getLogger("giantpipe")

FAILURES: list[str] = []
PREEMPTED_EXIT = 143
"""Exit status of a run SIGTERM stopped after saving (128 + 15, what shells report for it)."""
INTERRUPTED_EXIT = 130
"""Exit status of a run Ctrl-C stopped (128 + 2)."""
HANGUP_EXIT = 129
"""Exit status of a run SIGHUP stopped after saving (128 + 1)."""
STOP_EXITS = {"preempted": PREEMPTED_EXIT, "hangup": HANGUP_EXIT, "interrupted": INTERRUPTED_EXIT}
"""The summary status of a run a signal stopped -> its exit status."""
STOPPED: list[tuple[int, str]] = []
"""(exit status, line) of a run a signal stopped; :func:`guarded` exits with it."""
STARTED = time.time()
"""When this process started: a run directory made after it, and left empty, is ours."""
"""One line per failed job of this process; :func:`guarded` reports them and exits non-zero."""

OPTION_GROUPS = ("model", "data")
"""Groups whose options name a builder by ``_target_`` and may be typed by its schema."""

OPTION_SCHEMAS: dict[str, type] = {}
"""Schema name -> class, as registered (left out of the options a mistyped ``GROUP=`` lists)."""


def option_schemas(path: Path) -> dict[str, type]:
    """The schemas an option file names in its defaults list: dataclasses of its builder's module.

    Other defaults entries (another option of the group, to extend it) are left to Hydra.

    Example::

        option_schemas(Path("conf/model/mlp.yaml"))    # {"MlpModelConfig": MlpModelConfig}
    """
    option = OmegaConf.load(path)
    assert isinstance(option, DictConfig), f"{path} must hold a mapping"
    target = option.get("_target_")
    names = [n for n in option.get("defaults", []) if isinstance(n, str) and n != "_self_"]
    siblings = {p.stem for p in path.parent.glob("*.yaml")}
    wanted = [n for n in names if n not in siblings]
    if not wanted:
        return {}
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(str(path), f"names a schema ({wanted[0]}) but no _target_ builder")
    module_name = target.rpartition(".")[0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(str(path), f"cannot import {module_name!r} ({err})") from err
    schemas: dict[str, type] = {}
    for name in wanted:
        schema = getattr(module, name, None)
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            problem = f"defaults name {name}, which is neither an option of {path.parent.name}"
            raise ConfigError(str(path), f"{problem} nor a dataclass in {module_name}")
        builds = getattr(schema, "_target_", target)
        if builds != target:
            raise ConfigError(str(path), f"{name} describes {builds}, not _target_ {target}")
        schemas[name] = schema
    return schemas


def register_configs(conf_dir: Path) -> None:
    """Store the schemas in Hydra's ConfigStore, before ``@hydra.main`` or ``compose``:
    ``base_config`` (the experiment) and every schema the ``model`` / ``data`` options of
    ``conf_dir`` name (see the module docstring). It imports the builder module of every option
    that names a schema, so an option that cannot be imported stops every run with one line
    naming its file. Calling it again is harmless.

    Example::

        register_configs(Path("conf"))
        with initialize_config_dir(str(Path("conf").resolve()), version_base="1.3"):
            cfg = to_experiment(compose("config", ["recipe=mlp_quickstart"]))
    """
    store = ConfigStore.instance()
    store.store(name="base_config", node=ExperimentConfig)
    for group in OPTION_GROUPS:
        for path in sorted(Path(conf_dir, group).glob("*.yaml")):
            for name, schema in option_schemas(path).items():
                if OPTION_SCHEMAS.get(name, schema) is not schema:
                    raise ConfigError(str(path), f"a second schema named {name}")
                OPTION_SCHEMAS[name] = schema
                store.store(group=group, name=name, node=schema)


def renamed(key: str) -> str | None:
    """The new name of a renamed key or of a key under one; None for any other key.

    Example::

        renamed("optim.schedule.name")   # "optim.lr_schedule.name"
    """
    for old, new in RENAMED_KEYS.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old) :]
    return None


def to_experiment(cfg: DictConfig) -> ExperimentConfig:
    """The composed config as dataclasses (resolving interpolations, running every check)."""
    for old, new in RENAMED_KEYS.items():  # added with +KEY=..., which the schemas let through
        if OmegaConf.select(cfg, old, default=None) is not None:
            raise ConfigError(old, f"renamed to {new}")
    for group in OPTION_GROUPS:  # their schemas live beside the builders and check no nan
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            check_finite(OmegaConf.to_container(node, resolve=False), group)
    try:
        experiment = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except ValueError as err:  # a schema beside its builder: models/ raise "model.KEY: problem"
        raise as_config_error(err) from err
    assert isinstance(experiment, ExperimentConfig), "conf/config.yaml must start with base_config"
    return experiment


def as_config_error(err: ValueError) -> ValueError:
    """``ValueError("model.depth: must be >= 1, got 0")`` as the ConfigError it means; any other
    ValueError unchanged.

    Example::

        as_config_error(ValueError("model.depth: must be >= 1, got 0")).key   # "model.depth"
    """
    key, sep, problem = str(err).partition(": ")
    group = key.partition(".")[0]
    if sep and group in OPTION_GROUPS and re.fullmatch(r"[\w.]+", key):
        return ConfigError(key, problem)
    return err


def objective(summary: dict[str, object], key: str) -> float:
    """The number a sweeper optimizes: ``summary[sweep.objective]``."""
    if key not in summary:
        raise ConfigError("sweep.objective", f"{key!r} is not in the summary: {sorted(summary)}")
    return float(summary[key])  # type: ignore[arg-type]


def torchrun_rank() -> int:
    """This process's rank under torchrun (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def rank_overrides(argv: list[str], rank: int) -> list[str]:
    """Hydra overrides for a torchrun rank other than 0: no log file, no run directory of its
    own (its default would be a second, time-stamped one); rank 0's is used instead.

    Example::

        rank_overrides(["train.py", "recipe=mlp_quickstart"], rank=1)
        # [..., "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.run.dir=."]
    """
    if rank == 0:
        return argv
    extra = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        extra.append("hydra.run.dir=.")
    return [*argv, *extra]


def run_job(cfg: DictConfig) -> float:
    """Train one job; on failure record one line and return NaN instead of raising.

    Raising would make Hydra print its own multi-line report and, in a multirun, stop the
    remaining jobs; :func:`guarded` reports the recorded lines and sets the exit code.
    """
    from giantpipe.runner import train  # after Hydra set up logging and the run directory

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if STOPPED:  # a signal stopped an earlier job of this multirun: start no other
        _leave_as_found(run_dir)
        return math.nan
    try:
        experiment = to_experiment(cfg)
        check_known_keys(cfg, experiment)
        if multirun and experiment.pipeline.executor == "distributed":
            raise ConfigError(
                "pipeline.executor", "distributed runs one job per torchrun launch, not sweeps"
            )
        overrides = " ".join(hydra_cfg.overrides.task) or "(none)"
        # The resolved config, headed by the command line that produced it.
        config_yaml = f"# overrides: {overrides}\n" + OmegaConf.to_yaml(cfg, resolve=True)
        summary = train(experiment, run_dir, config_yaml, derived_keys(cfg))
        if _stopped(summary, run_dir):
            return math.nan
        if experiment.sweep.objective not in summary:  # a distributed run's rank > 0
            return math.nan
        return objective(summary, experiment.sweep.objective)
    except KeyboardInterrupt as err:  # the second Ctrl-C
        STOPPED.append((INTERRUPTED_EXIT, f"interrupted: {err or 'stopped at once by Ctrl-C'}"))
        return math.nan
    except Exception as err:  # noqa: BLE001 - every failure becomes one reported line
        if os.environ.get("GIANTPIPE_FULL_ERROR") == "1":
            raise
        FAILURES.append(_failure_line(err, run_dir, hydra_cfg, multirun))
        return math.nan


def derived_keys(cfg: DictConfig) -> list[str]:
    """The keys of the ``model`` and ``data`` groups that an interpolation sets (e.g.
    ``model.in_features: ${data.features}``): a resume compares their sources, not them.

    Example::

        derived_keys(cfg)     # ["model.classes", "model.in_features"] for recipe=mlp_quickstart
    """
    found = []
    for group in OPTION_GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            found += _interpolated(node, group)
    return found


def _interpolated(node: DictConfig, prefix: str) -> list[str]:
    found = []
    for key in map(str, node.keys()):
        if OmegaConf.is_interpolation(node, key):
            found.append(f"{prefix}.{key}")
        elif isinstance(child := node._get_node(key), DictConfig):
            found += _interpolated(child, f"{prefix}.{key}")
    return found


def _stopped(summary: dict[str, object], run_dir: Path) -> bool:
    """Records a run a signal stopped (after it saved), for :func:`guarded`'s exit status."""
    status = summary.get("status")
    if status not in STOP_EXITS:
        return False
    code = STOP_EXITS[str(status)]
    line = (
        f"{status} at step {summary.get('steps')}: saved {run_dir / 'last'}; continue with "
        f"trainer.resume=true hydra.run.dir={run_dir}"
    )
    STOPPED.append((code, line))
    return True


def _failure_line(err: Exception, run_dir: Path, hydra_cfg: Any, multirun: bool) -> str:
    """The one line of a failed job; a crash keeps its traceback beside the run, a refused
    config leaves the disk as it was."""
    line = one_line(err)
    if torchrun_rank() > 0:
        line = f"rank {torchrun_rank()}: {line}"
    elif isinstance(err, ConfigError | OmegaConfBaseException):
        _leave_as_found(run_dir)
    elif not isinstance(err, OSError):  # a crash, not the disk: keep the traceback, if it fits
        trace = run_dir / "error.txt"
        try:
            trace.write_text("".join(traceback.format_exception(err)))
            line = f"{line} (traceback: {trace})"
        except OSError:
            pass
    if multirun:
        line = f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)}): {line}"
        log.error(line)
    return line


def _leave_as_found(run_dir: Path) -> None:
    """Removes what Hydra made for a job this process refused: its empty log file and, when
    nothing else is in them, the run directory (and its date folder) made since we started."""
    log_file = run_dir / f"{HydraConfig.get().job.name}.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log_file:
            handler.close()
            root.removeHandler(handler)  # a later record would make the file again
    if log_file.is_file() and log_file.stat().st_size == 0:
        log_file.unlink()
    folder = run_dir
    while folder != folder.parent and folder != Path.cwd():
        try:
            if folder.stat().st_mtime < STARTED - 1 or any(folder.iterdir()):
                return
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def check_known_keys(cfg: DictConfig, experiment: ExperimentConfig) -> None:
    """Every key the composed config holds is a field of its schema: ``+KEY=VALUE`` may add a
    key no schema has (a typo), which Hydra lets through and the dataclasses would ignore."""
    for key in _extra_keys(cfg, experiment, ""):
        group, _, field = key.rpartition(".")
        node = experiment
        for part in group.split(".") if group else []:
            node = getattr(node, part)
        names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        close = difflib.get_close_matches(field, names, n=1)
        hint = f"; did you mean {group}.{close[0]}?" if close else ""
        raise ConfigError(key, f"unknown key (not a field of {type(node).__name__}){hint}")


def _extra_keys(node: Any, obj: Any, prefix: str) -> list[str]:
    if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(obj)):
        return []
    fields = {f.name for f in dataclasses.fields(obj)}
    found = []
    for key in map(str, node.keys()):
        name = f"{prefix}{key}"
        if key not in fields:
            found.append(name)
        else:
            found += _extra_keys(node._get_node(key), getattr(obj, key), f"{name}.")
    return found


def _first_line(text: str) -> str:
    return next((part.strip() for part in text.splitlines() if part.strip()), text.strip())


def one_line(err: BaseException) -> str:
    """A one-line description of ``err`` naming the config key or the path involved, and the
    reason (never only the first line of a message whose reason is on the next)."""
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    cause = err.__cause__ if isinstance(err, ConfigCompositionException) else err
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf_line(cause)
    if isinstance(cause, yaml.MarkedYAMLError):
        return _yaml_line(cause)
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    if isinstance(err.__cause__, OSError) and "configure handler" in str(err):
        # Hydra could not open the log file: the run directory is not writable
        io = err.__cause__
        return f"hydra.run.dir: cannot write {io.filename} ({io.strerror or io})"
    if isinstance(err, ConfigCompositionException):
        return _joined(str(err))
    return f"{type(err).__name__}: {_joined(str(err))}"


def _joined(text: str) -> str:
    """A message's lines on one line (its reason is often on the second)."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip()) or text.strip()


def _omegaconf_line(cause: OmegaConfBaseException) -> str:
    key = getattr(cause, "full_key", None) or ""
    if renamed(key):
        return f"{key}: renamed to {renamed(key)}"
    problem = _first_line(str(cause))
    if "not in" in problem and key:
        return f"{key}: unknown key ({problem})"
    return f"{key}: {problem}" if key else _joined(str(cause))


def _yaml_line(err: yaml.MarkedYAMLError) -> str:
    """``conf/optim/adamw.yaml:10: while parsing a flow sequence: expected ',' or ']'``."""
    mark = err.problem_mark or err.context_mark
    where = f"{mark.name}:{mark.line + 1}" if mark is not None else "a config file"
    reason = ": ".join(part for part in (err.context, err.problem) if part)
    return f"{where}: {reason or type(err).__name__}"


def _missing_option(err: MissingConfigException) -> str:
    """``model=foo``: an option that does not exist; list the real ones (schemas left out)."""
    found = re.search(r"Could not find '([^']+)/([^'/]+)'", str(err))
    if found is None:
        return _first_line(str(err))
    group, option = found.groups()
    # Hydra lists the options as tab-indented lines after "Available options in 'GROUP':".
    listing = str(err).partition("Available options")[2].split("Config search path")[0]
    options = [s.strip() for s in listing.splitlines()[1:] if s.startswith("\t")]
    shown = ", ".join(o for o in options if o not in OPTION_SCHEMAS)
    return f"{group}={option}: no such option" + (f" (available: {shown})" if shown else "")


class SweepTable(Callback):
    """Hydra callback: at the end of a multirun, the sweep's table and plot in its directory
    (:func:`giantpipe.metrics.write_sweep_table`), and the table on stdout.

    Example (conf/config.yaml)::

        hydra:
          callbacks:
            sweep_table:
              _target_: giantpipe.cli.SweepTable
    """

    def __init__(self) -> None:
        self.launched: dict[int, list[str]] = {}
        """Job number -> its overrides, for jobs refused before they left a directory."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        job = OmegaConf.select(config, "hydra.job.num", default=None)
        if job is not None and job_return.overrides is not None:
            self.launched[int(job)] = list(job_return.overrides)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from giantpipe.metrics import write_sweep_table

        sweep_dir = Path(str(config.hydra.sweep.dir))
        objective = str(OmegaConf.select(config, "sweep.objective", default="eval/loss"))
        try:
            written = write_sweep_table(sweep_dir, objective, self.launched)
        except Exception as err:  # noqa: BLE001 - a summary must never fail the sweep
            log.warning("sweep table not written: %s: %s", type(err).__name__, err)
            return
        if written:
            print(written[0].read_text(), flush=True)
            log.info("sweep table and plot: %s", ", ".join(str(p) for p in written))


def guarded(main: Callable[[], None], conf_dir: Path) -> None:
    """Register the schemas of ``conf_dir`` and run a ``@hydra.main`` function; report failures
    as one line each and exit non-zero (143 / 129 / 130 for a run a signal stopped)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ["GIANTPIPE_FULL_ERROR"] = "1"  # the user wants tracebacks: keep them
    else:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # make Hydra raise, so the error reaches us whole
    logging.raiseExceptions = False  # a log line lost to a full disk must not end the run
    sys.argv = rank_overrides(sys.argv, torchrun_rank())
    try:
        register_configs(conf_dir)
        main()
    except KeyboardInterrupt:
        print("error: interrupted before training started; nothing was written", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    except Exception as err:  # noqa: BLE001 - composition and launch errors
        if os.environ.get("GIANTPIPE_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)
    for line in FAILURES:
        print(f"error: {line}", file=sys.stderr)
    if STOPPED:
        code, line = STOPPED[0]
        print(line, file=sys.stderr)
        sys.exit(code)
    if FAILURES:
        sys.exit(1)
