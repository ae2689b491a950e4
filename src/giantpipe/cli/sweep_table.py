"""The sweep-table Hydra callback: a multirun's table and plot, written when it ends.

A multirun ends with ``sweep.md`` / ``sweep.csv`` / ``sweep.png`` in its sweep directory: each
job's swept overrides against ``sweep.objective``. The table itself is written by
:func:`giantpipe.metrics.write_sweep_table`; :class:`SweepTable` is the Hydra callback that
conf/config.yaml names under ``hydra.callbacks`` and that calls it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("giantpipe")


class SweepTable(Callback):
    """Hydra callback: at the end of a multirun, the sweep's table and plot in its directory
    (:func:`giantpipe.metrics.write_sweep_table`), and the table on stdout.

    Example (conf/config.yaml)::

        hydra:
          callbacks:
            sweep_table:
              _target_: giantpipe.cli.sweep_table.SweepTable
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
