"""The outside trackers: Weights & Biases and TensorBoard, each imported only when asked for.

One concept, two adapters of the same shape (``log(record, step)``, ``close``): both are
optional packages behind a one-line ImportError naming the extra, both flatten the per-stage
lists into stage-indexed scalars (``train/busy_time_s/stage0``). metrics.jsonl, the run's own
file that the runner and scripts read back, lives in :mod:`giantpipe.metrics.jsonl`.

- :class:`WandbSink`: Weights & Biases (``logger=wandb``); offline mode needs no network; each
  run (each sweep job too) opens its own W&B run and finishes it in :meth:`WandbSink.close`;
- :class:`TensorBoardSink`: a TensorBoard event file in ``RUN_DIR/tensorboard``
  (``logger.tensorboard=true``; ``tensorboard --logdir outputs`` shows every run).
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


class TensorBoardSink:
    """Scalars to a TensorBoard event file under ``log_dir`` (``torch.utils.tensorboard``, which
    needs the ``tensorboard`` package: ``pip install 'giantpipe[tensorboard]'``).

    Example::

        sink = TensorBoardSink(run_dir / "tensorboard")
        sink.log({"train/loss": 1.9, "train/busy_time_s": [0.1, 0.2]}, step=10)
        sink.close()          # tensorboard --logdir outputs
    """

    def __init__(self, log_dir: Path, resumed_at: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "logger.tensorboard=true needs tensorboard: pip install 'giantpipe[tensorboard]'"
            ) from err
        # A resumed run hides the events past its checkpoint that the interrupted one wrote,
        # as metrics.jsonl is cut back: every step is shown once.
        purge = resumed_at + 1 if resumed_at else None
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in record.items():
            if isinstance(value, bool) or not isinstance(value, int | float | list):
                continue
            values = value if isinstance(value, list) else [value]
            names = (
                [f"{key}/stage{i}" for i in range(len(values))]
                if isinstance(value, list)
                else [key]
            )
            for name, number in zip(names, values):
                if isinstance(number, int | float) and not isinstance(number, bool):
                    self._writer.add_scalar(name, number, global_step=step)
        self._writer.flush()  # a crash loses nothing already logged

    def close(self) -> None:
        self._writer.close()
