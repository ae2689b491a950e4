"""One job of ``train.py``: check the config, train, and turn the outcome into an exit status.

The config is checked before torch is imported; a refusal exits 2, a failed run 1, a signal
129, 130 or 143 after saving, each reported as one line
(docs/command-line.md#errors-come-first-and-fast). ``train.py`` is a thin ``@hydra.main``
around :func:`run_job`, started by :func:`guarded`.

Example::

    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    def main(cfg: DictConfig) -> float:
        return run_job(cfg)

    if __name__ == "__main__":
        guarded(main, conf_dir=Path(__file__).parent / "conf")   # registers, then runs
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from giantpipe.cli.checks import check_config, check_fits, late_checks
from giantpipe.cli.errors import is_config_error, one_line, one_line_warning
from giantpipe.cli.registration import CONF_DIRS, STARTED, register_configs
from giantpipe.cli.schemas import OPTION_GROUPS
from giantpipe.cli.usage import usage
from giantpipe.config import ConfigError

log = logging.getLogger("giantpipe")

FAILURES: list[tuple[int, str, str]] = []
"""(exit status, line, the line as any rank says it) per failed job of this process;
:func:`guarded` reports them and exits with the first status: 2 for a refused config, 1 for a
run that failed."""
USAGE_EXIT = 2
"""Exit status of a usage or config error (a typo, a bad value, an option that does not fit)."""
FAILED_EXIT = 1
"""Exit status of a run that started and failed."""
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

    The config is checked before the runner (and torch) is imported, so a typo or a bad value is
    reported at once. Raising would make Hydra print its own multi-line report and, in a
    multirun, stop the remaining jobs; :func:`guarded` reports the recorded lines and sets the
    exit code.
    """
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if STOPPED:  # a signal stopped an earlier job of this multirun: start no other
        _leave_as_found(run_dir)
        return math.nan
    try:
        check_fits(cfg, dict(hydra_cfg.runtime.choices), CONF_DIRS[-1] if CONF_DIRS else None)
        experiment = check_config(cfg)
        if multirun and experiment.pipeline.executor == "distributed":
            raise ConfigError(
                "pipeline.executor", "distributed runs one job per torchrun launch, not sweeps"
            )
        ignore_save_signal(experiment.trainer.save_signal)
        from giantpipe.runner import train  # torch: only once the config holds

        experiment = late_checks(experiment)  # rules needing torchvision's or transformers' lists

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
        code = USAGE_EXIT if is_config_error(err) else FAILED_EXIT
        line = _failure_line(err, run_dir, hydra_cfg, multirun)
        FAILURES.append((code, line, one_line(err)))
        return math.nan


def ignore_save_signal(name: str | None) -> None:
    """``trainer.save_signal`` outside the run (while it is set up, once it has ended) is
    ignored: SIGUSR1's default action would kill the process (exit -10). The run catches it
    meanwhile (giantpipe.runner.world.StopSignals, which puts this back when the run ends).

    Example::

        ignore_save_signal("SIGUSR1")       # SLURM's --signal=USR1@120 can come at any time
    """
    if name is not None and threading.current_thread() is threading.main_thread():
        signal.signal(getattr(signal, name), signal.SIG_IGN)


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
    elif is_config_error(err):
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


def first_to_refuse(line: str) -> bool:
    """Whether this process reports the config error ``line``: every rank of a torchrun launch
    checks the same config and would print the same line, so only the first of its host to
    refuse it does (rank 0 or another), through a marker file per launch. The others wait for
    it to have exited, so that torchrun, stopping the launch at their exit, cannot stop it
    before it has said why. Outside torchrun, always.

    Example::

        if first_to_refuse(line):
            print(f"error: {line}", file=sys.stderr)
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    launch = f"{os.getppid()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    marker = Path(tempfile.gettempdir(), f"giantpipe-refused-{launch}-{_digest(line)}")
    _forget_old_markers(marker.parent)
    try:
        handle = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        _wait_for_reporter(marker)
        return False
    except OSError:
        return True  # no marker here: better twice than never
    os.write(handle, str(os.getpid()).encode())
    os.close(handle)
    return True


def _digest(line: str) -> str:
    return hashlib.sha1(line.encode()).hexdigest()[:16]


def _forget_old_markers(folder: Path) -> None:
    for old in folder.glob("giantpipe-refused-*"):  # a day old: their launches are over
        try:
            if old.stat().st_mtime < time.time() - 86400:
                old.unlink()
        except OSError:
            pass


def _wait_for_reporter(marker: Path, patience: float = 5.0) -> None:
    """Until the process that wrote ``marker`` (its PID) has exited, at most ``patience`` s."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            pid = int(marker.read_text() or "0")
            if pid:
                os.kill(pid, 0)
                if _exited(pid):
                    return
        except (OSError, ValueError):  # gone (or no marker left): it has said it
            return
        time.sleep(0.02)


def _exited(pid: int) -> bool:
    """A process that has exited and waits to be reaped (a zombie, on Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def guarded(main: Callable[[], None], conf_dir: Path) -> None:
    """Register the schemas of ``conf_dir`` and run a ``@hydra.main`` function; report failures
    as one line each and exit non-zero (143 / 129 / 130 for a run a signal stopped)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ["GIANTPIPE_FULL_ERROR"] = "1"  # the user wants tracebacks: keep them
    else:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # make Hydra raise, so the error reaches us whole
    logging.raiseExceptions = False  # a log line lost to a full disk must not end the run
    warnings.formatwarning = one_line_warning  # not the line of source that warned
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(usage(conf_dir))  # ours, not Hydra's: it composes nothing and names the recipes
        sys.exit(0)
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
        if first_to_refuse(one_line(err)):
            print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    for code, line, said in FAILURES:
        if code != USAGE_EXIT or first_to_refuse(said):
            print(f"error: {line}", file=sys.stderr)
    if STOPPED:
        code, line = STOPPED[0]
        print(line, file=sys.stderr)
        sys.exit(code)
    if FAILURES:
        sys.exit(max(code for code, _, _ in FAILURES))  # a refused job (2) outranks a failed one
