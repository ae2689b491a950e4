"""Measured vs predicted in every run: the simulator's forecast beside the engine's own figures.

After the warm-up step the stages are profiled once (under torchrun: the ranks' own timings
after the second step), and at the end the prediction is set against the measured steps, with a
warning above a 25% gap and the timelines drawn: docs/performance.md#the-simulator-beside-every-run.

Example::

    forecast = Forecast(world)
    forecast.after_step(parts, "fp32", batches[0], stats, step, more=True)  # every step
    forecast.report()                                           # logs predicted vs measured
    summary.update(forecast.figures())                                 # pipeline/predicted_*
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from giantpipe.data.bundle import Batch, batch_size
from giantpipe.engine.distributed.pipe import DistributedPipe
from giantpipe.engine.gpipe import GPipe
from giantpipe.engine.recompute import recompute_stop
from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.stats import ActionTiming
from giantpipe.metrics.step import EngineStats
from giantpipe.runner.step import autocast, to_device
from giantpipe.runner.world import World

if TYPE_CHECKING:
    from giantpipe.perf.predict import Prediction
    from giantpipe.runner.build import Experiment

log = logging.getLogger(__name__)

WARN_ABOVE = 0.25
"""Warn when |measured / predicted - 1| of the engine step exceeds this."""


class Forecast:
    """One prediction per run, and the measured engine steps that follow it."""

    def __init__(self, world: World | None = None) -> None:
        self.world = world or World()
        self.prediction: Prediction | None = None
        self.predict_time_s = 0.0
        self._done = False
        self._seen = 0  # optimizer steps seen before the prediction
        self._time = self._bubble = 0.0
        self._count = 0

    def after_step(
        self,
        parts: Experiment,
        precision: str,
        batch: Batch | None,
        stats: Sequence[EngineStats],
        step: int,
        more: bool,
    ) -> None:
        """Predict after the first step (under torchrun the second), when steps remain to
        compare with; then measure. Collective under torchrun (every rank calls it)."""
        if self._done:
            if self.prediction is not None:
                self._time += sum(s.wall_time_s for s in stats)
                self._bubble += sum(s.bubble for s in stats)
                self._count += len(stats)
            return
        self._seen += 1
        distributed = self.world.size > 1
        if distributed and self._seen < 2 and more:
            return
        self._done = True
        if more and distributed:
            self._predict_distributed(parts, batch, step)
        elif more and batch is not None:
            self._predict(parts, precision, batch, step)

    def _predict(self, parts: Experiment, precision: str, batch: Batch, step: int) -> None:
        from giantpipe.perf.predict import predict

        inputs, targets = (
            to_device(batch[0], parts.input_device),
            to_device(batch[1], parts.target_device),
        )
        cuda = [torch.device(d) for d in parts.spec.devices or () if torch.device(d).type == "cuda"]
        started = time.perf_counter()
        try:
            with torch.random.fork_rng(devices=cuda), autocast(precision, parts.input_device):
                pipe = cast(GPipe, parts.pipe)  # the local executor's
                self.prediction = predict(pipe, inputs, targets, parts.loss_fn, repeats=1)
        except Exception as err:  # a diagnostic: say so, and train on
            log.warning(
                "no prediction: profiling the stages failed: %s: %s", type(err).__name__, err
            )
            return
        self.predict_time_s = time.perf_counter() - started
        log.info(
            "simulator (stages profiled after step %d, %.1fs): predicted step %.3g s, bubble %.2f",
            step,
            self.predict_time_s,
            self.prediction.step_time_s,
            self.prediction.bubble,
        )

    def _predict_distributed(self, parts: Experiment, batch: Batch | None, step: int) -> None:
        """Every rank: its timings and parameter bytes to rank 0, its boundaries probed; rank 0
        simulates the schedule on the costs they make."""
        from giantpipe.engine.distributed.layout import comm_device
        from giantpipe.perf.measured import probe_link, stage_costs
        from giantpipe.perf.predict import Prediction
        from giantpipe.perf.simulate import simulate

        pipe, world, started = cast(DistributedPipe, parts.pipe), self.world, time.perf_counter()
        schedule, leader = pipe.step_schedule(), pipe.replica == 0
        held = {s: _static_bytes(pipe.partitions[s]) for s in pipe.layout.local_stages}
        gathered = world.gather((pipe.last_timings, held) if leader else ([], {}))
        timings = [t for part, _ in gathered for t in part]
        static = {s: n for _, part in gathered for s, n in part.items()}
        crossings = world.from_rank0(_crossings(schedule, timings) if world.rank == 0 else [])
        group, link = pipe.groups.p2p, comm_device(pipe.device)  # the boundary payloads' link
        probed = world.gather([probe_link(group, *c[1:], world.rank, link) for c in crossings])
        if world.rank != 0 or batch is None:
            return
        sends = [0.0] * schedule.num_stages
        for i, (stage, sender, _, _) in enumerate(crossings):
            sends[stage] = probed[sender][i]
        stop = recompute_stop(pipe.recompute, pipe.chunks)
        bytes_of = [static.get(s, 0) for s in range(schedule.num_stages)]
        costs = stage_costs(timings, schedule.num_stages, stop, sends, bytes_of)
        sim = simulate(schedule, costs, pipe.recompute)
        rate = sim.samples_per_second(batch_size(batch[0]))
        self.prediction = Prediction(
            sim.step_time, rate, sim.bubble, sim.peak_memory_bytes, sim, costs, 0.0, 1.0
        )
        self.predict_time_s = time.perf_counter() - started
        log.info(
            "simulator (every rank's actions as timed in step %d, boundaries probed, %.1fs): "
            "predicted step %.3g s, bubble %.2f",
            step,
            self.predict_time_s,
            sim.step_time,
            sim.bubble,
        )

    def measured(self) -> tuple[float, float] | None:
        """Mean engine step time (s) and bubble since the prediction; None before any."""
        if not self._count:
            return None
        return self._time / self._count, self._bubble / self._count

    def line(self) -> str | None:
        """``predicted step 0.123 s bubble 0.20 | measured 0.131 s bubble 0.22 (+6%)``."""
        if self.prediction is None:
            return None
        p = self.prediction
        text = f"predicted step {p.step_time_s:.3g} s bubble {p.bubble:.2f}"
        measured = self.measured()
        if measured is None:
            return text + " | measured: no step after the prediction"
        gap = measured[0] / p.step_time_s - 1
        return text + f" | measured {measured[0]:.3g} s bubble {measured[1]:.2f} ({gap:+.0%})"

    def report(self, run_dir: Path | None = None, pipe: Any = None) -> None:
        """Log the line, and a warning when the measured step departs by more than 25%; with
        ``run_dir``, draw the predicted step and ``pipe``'s last step there, side by side."""
        line = self.line()
        if line is None:
            return
        log.info("engine step, simulator vs measured: %s", line)
        if run_dir is not None:
            self._plot(run_dir, pipe)
        measured = self.measured()
        assert self.prediction is not None
        if measured is not None and abs(measured[0] / self.prediction.step_time_s - 1) > WARN_ABOVE:
            log.warning(
                "the measured engine step (%.3g s) departs from the simulator's prediction "
                "(%.3g s) by more than %.0f%%: the machine was busier or quieter than while "
                "profiling, or the stage costs do not add up as the simulator assumes",
                measured[0],
                self.prediction.step_time_s,
                WARN_ABOVE * 100,
            )

    def _plot(self, run_dir: Path, pipe: Any) -> None:
        """timeline_predicted.png and timeline_measured.png (the run's last engine step)."""
        from giantpipe.perf.timeline import plot_measured, plot_timeline

        assert self.prediction is not None
        try:
            paths = [plot_timeline(self.prediction.simulation, run_dir / "timeline_predicted.png")]
            timings = getattr(pipe, "last_timings", None)
            if timings and self.world.size == 1:  # one process, one clock
                schedule = pipe.step_schedule()
                paths.append(plot_measured(timings, schedule, run_dir / "timeline_measured.png"))
        except Exception as err:  # a diagnostic: say so, and finish the run
            log.warning("timelines not drawn: %s: %s", type(err).__name__, err)
            return
        log.info("timelines, predicted and measured: %s", ", ".join(str(p) for p in paths))

    def figures(self) -> dict[str, Any]:
        """summary.json keys: pipeline/predicted_* and the measured engine step beside them."""
        if self.prediction is None:
            return {}
        p = self.prediction
        figures: dict[str, Any] = {
            "pipeline/predicted_step_time_s": p.step_time_s,
            "pipeline/predicted_bubble": p.bubble,
            "pipeline/predicted_peak_memory_bytes": list(p.peak_memory_bytes),
            "pipeline/predict_time_s": self.predict_time_s,
        }
        measured = self.measured()
        if measured is not None:
            figures["pipeline/step_time_s"] = measured[0]
            figures["pipeline/step_time_vs_predicted"] = measured[0] / p.step_time_s - 1
        return figures


def _static_bytes(stage: torch.nn.Module) -> int:
    """Weights and their gradients: what a stage holds whatever the step does."""
    return 2 * sum(p.numel() * p.element_size() for p in stage.parameters())


def _crossings(
    schedule: Schedule, timings: Sequence[ActionTiming]
) -> list[tuple[int, int, int, int]]:
    """(stage, sending rank, receiving rank, bytes) of every boundary between two ranks of
    replica 0, the bytes those the next stage's forwards received."""
    found = []
    for stage in range(schedule.num_stages - 1):
        sender, receiver = schedule.placement[stage], schedule.placement[stage + 1]
        if sender == receiver:
            continue
        received = [
            t.received for t in timings if t.action.kind == "F" and t.action.stage == stage + 1
        ]
        nbytes = sorted(received)[len(received) // 2] if received else 0
        found.append((stage, sender, receiver, nbytes))
    return found
