"""The update that closes an optimizer step, one rule for the local and distributed loops.

After the engine steps (gradients accumulated over ``trainer.accumulate`` batches) and clipping:
the optimizer and the learning-rate schedule step, the EMA follows, the progress advances, and
the step's figures become a :class:`~giantpipe.metrics.record.StepRecord`. Under the distributed
runner a rank that holds no data sees ``None`` batches; it counts them, but no samples.

Example::

    record = apply_update(parts, progress, batches, loss, stats, grad_norm, started)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from giantpipe.data.bundle import Batch, batch_size
from giantpipe.metrics.record import EngineStats, StepRecord


def apply_update(
    parts: Any,
    progress: Any,
    batches: Sequence[Batch | None],
    loss: float,
    stats: list[EngineStats],
    grad_norm: float | None,
    started: float,
) -> StepRecord:
    """Steps ``parts``' optimizer, scheduler and EMA, advances ``progress`` by one step and
    ``len(batches)`` batches, and returns the step's record (``started``: its perf_counter)."""
    lr = float(parts.optimizer.param_groups[0]["lr"])  # the rate this step used
    parts.optimizer.step()
    parts.scheduler.step()
    if parts.ema is not None:
        parts.ema.update()
    progress.step += 1
    progress.position += len(batches)
    held = [b for b in batches if b is not None]
    tokens = parts.bundle.tokens_per_batch
    return StepRecord.from_engine(
        stats,
        step=progress.step,
        loss=loss,
        lr=lr,
        step_time_s=time.perf_counter() - started,
        samples=sum(batch_size(inputs) for inputs, _ in held),
        tokens=sum(tokens(b) for b in held) if tokens is not None and held else None,
        grad_norm=grad_norm,
    )
