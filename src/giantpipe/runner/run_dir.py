"""The run directory: where a run starts or resumes, and what it may write there.

A fresh run refuses a directory that already holds a checkpoint (it would overwrite it); a
resume needs one. Both are decided before anything is written.

Example::

    checkpoint = resume_checkpoint(cfg.trainer.resume, run_dir)   # None for a fresh run
"""

from __future__ import annotations

import os
from pathlib import Path

from giantpipe.config import ConfigError

LAST = "last.pt"


def resume_checkpoint(resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None; ConfigError when the request cannot be met.

    Example::

        resume_checkpoint(True, Path("outputs/2024-05-01/10-00-00"))   # .../last.pt
    """
    if resume is False:
        if (run_dir / LAST).exists():
            raise ConfigError(
                "trainer.resume",
                f"{run_dir} already holds a run ({LAST}); pass trainer.resume=true to continue "
                "it, or choose another hydra.run.dir",
            )
        return None
    path = run_dir / LAST if resume is True else Path(str(resume)).expanduser()
    if not path.is_file():
        raise ConfigError("trainer.resume", f"no checkpoint at {path}")
    if (run_dir / LAST).exists() and not (run_dir / LAST).samefile(path):
        raise ConfigError(
            "trainer.resume",
            f"{run_dir} holds another run's {LAST}; resume from a checkpoint into a new directory",
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
