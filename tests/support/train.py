"""``train.py`` (or another script of a checkout) in a process of its own, as a user runs it,
and its output read: one process, or two ranks under torchrun; or, where a test only needs the local
executor's result, the same job in the test's own process (:func:`train_here`).

Every command gets the checkout on ``PYTHONPATH``, W&B offline and ``HYDRA_FULL_ERROR`` unset (the
one-line errors a user sees); a timeout is lengthened by tests/timeouts.py's knob and, run out,
says so.

Example::

    done = ok(train("recipe=mlp_quickstart", "trainer.max_steps=2", cwd=tmp_path))
    line = one_error_line(train("trainer.foo=1", cwd=tmp_path))
    code, out = finish(train_under_torchrun(tmp_path / "run", "recipe=mlp_quickstart"), 240)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.forks import forkable, run_script
from tests.timeouts import run, scaled

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "train.py"
HEAVY = ("torch", "torchvision", "transformers")
"""Packages a command that only reads its config must not import."""


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment as a command of the checkout needs it, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("WANDB_MODE", "offline")
    env.update(extra or {})
    return env


def command(*args: str, script: Path = TRAIN, importtime: bool = False) -> list[str]:
    """``python [-X importtime] SCRIPT ARGS``."""
    flags = ["-X", "importtime"] if importtime else []
    return [sys.executable, *flags, str(script), *args]


def train(
    *args: str,
    cwd: Path,
    timeout: float = 120,
    importtime: bool = False,
    script: Path = TRAIN,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` in ``cwd`` to its end, its output captured; fails, saying so,
    after ``scaled(timeout)`` s. Forked from the tests' server (:mod:`tests.support.forks`, the
    imports done once) where a fork shows what a fresh interpreter would; ``importtime`` (``-X
    importtime``, read by :func:`imported`), a script of another checkout or a ``PYTHONPATH`` in
    ``env``: a new interpreter."""
    if not importtime and forkable(script, env):
        return run_script(script, list(args), cwd, environment(env), timeout)
    full = command(*args, script=script, importtime=importtime)
    return run(full, timeout, cwd=cwd, env=environment(env), capture_output=True, text=True)


def start_train(
    *args: str,
    cwd: Path,
    script: Path = TRAIN,
    env: dict[str, str] | None = None,
    **popen: Any,
) -> subprocess.Popen[str]:
    """``python SCRIPT ARGS`` started in ``cwd`` (a test that signals or kills it), stdout and
    stderr piped unless ``popen`` says otherwise (e.g. a pty, a session of its own)."""
    streams: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    full = command(*args, script=script)
    return subprocess.Popen(full, cwd=cwd, env=environment(env), text=True, **streams)


def train_under_torchrun(
    run_dir: Path, *overrides: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``torchrun --nproc_per_node=2 train.py OVERRIDES pipeline.executor=distributed`` into
    ``run_dir`` on a free loopback port, ``pipeline.timeout`` the scaled ``timeout`` (wait for
    it with :func:`tests.support.ranks.finish`)."""
    from giantpipe.testing import free_port
    from tests.support.ranks import torchrun  # torch: only the tests that launch ranks import it

    rendezvous = [
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "--max_restarts=0",
    ]
    pipeline = ["pipeline.executor=distributed", f"pipeline.timeout={scaled(timeout):g}"]
    job = [str(TRAIN), *overrides, *pipeline, f"hydra.run.dir={run_dir}"]
    return torchrun([*rendezvous, *job], env=env)


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``result``, which must have succeeded (else its stderr's end is the failure)."""
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The ``error:`` lines of a command's stderr."""
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed, which must be all it printed."""
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def imported(result: subprocess.CompletedProcess[str]) -> set[str]:
    """Top-level packages ``-X importtime`` saw imported (its lines end with the module name)."""
    rows = [line.rpartition("|")[2] for line in result.stderr.splitlines()]
    return {row.strip().split(".")[0] for row in rows if row.startswith(" ")}


def train_here(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """The job ``python train.py OVERRIDES hydra.run.dir=RUN_DIR`` runs, in this process: the
    config composed from conf/, checked, recorded in ``config.yaml`` with its command line, and
    trained by the local executor; its summary. What a test compares with a torchrun run, at no
    second interpreter's cost (torch is imported here already)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from giantpipe.cli.checks import to_experiment
    from giantpipe.cli.job import derived_keys
    from giantpipe.cli.registration import register_configs
    from giantpipe.runner import train as train_in_process

    register_configs(REPO / "conf")
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", list(overrides))
    experiment = to_experiment(cfg)
    config_yaml = f"# overrides: {' '.join(overrides)}\n" + OmegaConf.to_yaml(cfg, resolve=True)
    return train_in_process(experiment, run_dir, config_yaml, derived_keys(cfg))
