"""The data's whole-model evaluation (runner/evaluate.py): every hook gets the pipe as its whole
model (a PipedModel over the pipe itself, for every schedule: with virtual stages too), no plain
copy of the model; a hook written against a plain model's forward gives the plain model's
figures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.data.bundle import DataBundle
from giantpipe.engine.inference import PipedModel
from giantpipe.runner.evaluate import whole_model_figures
from giantpipe.runner.world import World

X = torch.randn(6, 4)


class Seen:
    """A user's hook written against a plain model: the mean of its outputs on fixed inputs."""

    def __init__(self) -> None:
        self.got: list[object] = []

    def __call__(self, model: PipedModel) -> dict[str, float | str]:
        self.got.append(model)
        return {"mean": float(model(X).mean()), "note": "seen"}


def run(pipe: nn.Module) -> tuple[dict[str, float | str], object]:
    hook = Seen()
    bundle = DataBundle(
        train_batches=lambda seed, position: iter([]),
        eval_batches=lambda: [],
        batches_per_epoch=1,
        evaluate_model=hook,
    )
    figures = whole_model_figures(pipe, bundle, World())  # type: ignore[arg-type]
    assert len(hook.got) == 1
    return figures, hook.got[0]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])


def test_every_hook_gets_the_pipe_as_its_whole_model_for_every_schedule() -> None:
    with torch.no_grad():
        plain = {"mean": pytest.approx(float(model()(X).mean())), "note": "seen"}
    pipe = GPipe(model(), balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    figures, got = run(pipe)
    assert isinstance(got, PipedModel) and got.pipe is pipe and figures == plain
    interleaved = GPipe(
        model(), [1, 1, 1, 1], devices=["cpu", "cpu"], chunks=2, schedule="interleaved",
        virtual_stages=2,
    )  # fmt: skip
    figures, got = run(interleaved)
    assert isinstance(got, PipedModel) and got.pipe is interleaved and figures == plain


def test_no_hook_no_figures() -> None:
    bundle = DataBundle(
        train_batches=lambda seed, position: iter([]), eval_batches=lambda: [], batches_per_epoch=1
    )
    assert whole_model_figures(GPipe(model(), [4], devices=["cpu"]), bundle, World()) == {}
