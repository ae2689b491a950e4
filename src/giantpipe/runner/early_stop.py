"""Early stopping: ``trainer.early_stop_patience`` evaluations in a row without the monitored
figure improving by ``trainer.early_stop_min_delta`` end the run (exit 0), as Lightning's
``EarlyStopping`` does.

>>> stopping = EarlyStopping(Monitor("eval/loss", "min"), patience=2, min_delta=0.01)
>>> stopping.observe(10, {"eval/loss": 0.5}), stopping.observe(20, {"eval/loss": 0.495})
(None, None)
>>> print(stopping.observe(30, {"eval/loss": 0.6}))
stopped early at step 30: eval/loss did not improve by 0.01 for 2 evaluations (best 0.5 at step 10)
"""

from __future__ import annotations

from collections.abc import Mapping

from giantpipe.runner.monitor import Monitor


class EarlyStopping:
    """Counts the evaluations since the monitored figure last improved by more than
    ``min_delta``; :meth:`observe` says why the run stops once they reach ``patience``."""

    def __init__(self, monitor: Monitor, patience: int, min_delta: float = 0.0) -> None:
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.best: tuple[int, float] | None = None
        """The step and value to beat."""
        self.waited = 0
        """Evaluations since the figure last improved."""

    def replay(self, evaluations: Mapping[int, Mapping[str, float]]) -> None:
        """The run's earlier evaluations, in step order (a resumed run counts on where it was)."""
        for step in sorted(evaluations):
            self.observe(step, evaluations[step])

    def observe(self, step: int, figures: Mapping[str, float]) -> str | None:
        """One evaluation's ``eval/`` figures; the line saying why the run stops, else None.
        A missing or non-finite figure is no improvement."""
        value = self.monitor.value(figures)
        if value is not None and self.best is None:
            self.best = (step, value)
        elif value is not None and self.best is not None:
            if self.monitor.better(value, self.best[1], by=self.min_delta):
                self.best, self.waited = (step, value), 0
            else:
                self.waited += 1
        else:
            self.waited += 1
        if self.waited < self.patience:
            return None
        best = f" (best {self.best[1]:.6g} at step {self.best[0]})" if self.best else ""
        return (
            f"stopped early at step {step}: {self.monitor.key} did not improve by "
            f"{self.min_delta:g} for {self.waited} evaluations{best}"
        )
