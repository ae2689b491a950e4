"""trainer.label_smoothing reaches the loss the run trains on (issue 40): one optimizer step of
the runner's loop against the plain model's step with torch's smoothed cross-entropy."""

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from giantpipe.runner.build import build_experiment
from giantpipe.runner.loop import TrainingLoop
from giantpipe.runner.run_state.state import Progress
from giantpipe.runner.seeding import seed_everything
from giantpipe.runner.world import World
from giantpipe.testing import reference_step
from tests.support.runs import tiny

SMOOTHING = 0.3


def test_one_step_trains_on_the_smoothed_loss_as_the_plain_model(tmp_path: Path) -> None:
    cfg = tiny(label_smoothing=SMOOTHING, predict=False)
    seed_everything(cfg.trainer.seed)  # as train() does
    parts = build_experiment(cfg)
    x, y = next(parts.bundle.train_batches(cfg.trainer.seed, 0))
    chunks, seed = cfg.pipeline.chunks, 0  # the dropout seed: the model has no dropout
    smoothed = partial(F.cross_entropy, label_smoothing=SMOOTHING)
    plain, want = reference_step(parts.model, x, y, chunks, seed, loss_fn=smoothed)
    _, unsmoothed = reference_step(parts.model, x, y, chunks, seed)
    # the smoothing shows in the loss: 100x the tolerance the runner's loss is held to below
    # (how much depends on the initial weights, which are the model's own init per layer)
    assert abs(want - unsmoothed) > 1e-3 * want

    loop = TrainingLoop(cfg, parts, tmp_path, None, Progress(), None, World())
    record = loop.optimizer_step(iter([(x, y)]))  # the step's gradients stay in .grad
    assert record.loss == pytest.approx(want, rel=1e-5)
    expected = dict(plain.named_parameters())
    for name, p in parts.names.items():
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-4, atol=1e-7)
