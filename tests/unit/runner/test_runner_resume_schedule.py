"""A resumed run continues the learning-rate schedule where it stopped (issue 40).

The resume tests beside it train at a constant rate, where a schedule restarted from step 0
gives the same numbers; here every step has its own rate (a linear warm-up over the whole run),
so the rates the optimizer trained at, as the run's record logs them, show where a resumed
schedule stands.
"""

from pathlib import Path

from giantpipe.config import ExperimentConfig, LRScheduleConfig, OptimConfig
from giantpipe.metrics.jsonl import read_jsonl
from giantpipe.runner import train
from tests.support.runs import tiny

STEPS, STOP = 4, 2  # the run, and where it is interrupted


def warming_up(max_steps: int, resume: bool = False) -> ExperimentConfig:
    cfg = tiny(max_steps=max_steps, eval_every=0, log_every=1, predict=False, resume=resume)
    warm_up = LRScheduleConfig(warmup_steps=STEPS)  # step s trains at (s + 1) / STEPS of lr
    cfg.optim = OptimConfig(name="sgd", lr=0.5, lr_schedule=warm_up)
    return cfg


def test_a_resumed_run_trains_each_step_at_the_rate_of_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    train(warming_up(STOP), tmp_path, "")
    resumed = train(warming_up(STEPS, resume=True), tmp_path, "")
    assert resumed["steps"] == STEPS
    lines = read_jsonl(tmp_path / "metrics.jsonl")  # both runs' steps
    rates = [(r["step"], r["lr"]) for r in lines if r["kind"] == "train"]
    assert rates == [(1, 0.125), (2, 0.25), (3, 0.375), (4, 0.5)]
