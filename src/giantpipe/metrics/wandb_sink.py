"""Weights & Biases, opt-in (``logger=wandb``); offline mode needs no network.

Each run (each sweep job too) opens its own W&B run in the run directory and finishes it in
:meth:`WandbSink.close`, so a multirun leaves no run open.

Example::

    sink = WandbSink(project="giantpipe", mode="offline", run_dir=run_dir, name="k2_m4",
                     config=asdict(cfg))
    sink.log({"loss": 1.2}, step=10)
    sink.close({"eval/loss": 0.4})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WandbSink:
    """Logs records to a W&B run; ``wandb`` is imported only when this sink is used."""

    def __init__(
        self, project: str, mode: str, run_dir: Path, name: str, config: dict[str, Any]
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("logger=wandb needs wandb: pip install 'giantpipe[wandb]'") from err
        self._wandb = wandb
        self._run = wandb.init(
            project=project,
            mode=mode,  # type: ignore[arg-type]  # one of LoggerConfig's WANDB_MODES
            dir=str(run_dir),
            name=name,
            config=config,
        )

    def log(self, record: dict[str, Any], step: int) -> None:
        flat = {k: v for k, v in record.items() if isinstance(v, int | float)}
        for key, values in record.items():
            if isinstance(values, list):  # per-stage figures become stage-indexed scalars
                flat.update({f"{key}/stage{i}": v for i, v in enumerate(values)})
        self._run.log(flat, step=step)

    def close(self, summary: dict[str, Any]) -> None:
        self._run.summary.update({k: v for k, v in summary.items() if not isinstance(v, list)})
        self._wandb.finish()
