"""The data's whole-model evaluation: a hook that decodes through the pipe (``takes_pipe``, as
held-out BLEU) gets the pipe, for every schedule: with virtual stages (interleaved, zb-v) too,
since generation runs through a worker holding several stages; no whole plain model is used."""

from __future__ import annotations

from torch import nn

from giantpipe import GPipe
from giantpipe.data.bundle import DataBundle
from giantpipe.runner.evaluate import whole_model_figures
from giantpipe.runner.world import World


class Seen:
    takes_pipe = True

    def __init__(self) -> None:
        self.got: list[nn.Module] = []

    def __call__(self, model: nn.Module) -> dict[str, float | str]:
        self.got.append(model)
        return {"seen": 1.0}


def run(pipe: nn.Module, model: nn.Sequential) -> nn.Module:
    hook = Seen()
    bundle = DataBundle(
        train_batches=lambda seed, position: iter([]),
        eval_batches=lambda: [],
        batches_per_epoch=1,
        evaluate_model=hook,
    )
    assert whole_model_figures(pipe, model, bundle, World()) == {"seen": 1.0}  # type: ignore[arg-type]
    return hook.got[0]


def test_the_pipe_is_handed_over_even_when_a_worker_holds_several_stages() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    pipe = GPipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    assert run(pipe, model) is pipe
    looped = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    interleaved = GPipe(
        looped, [1, 1, 1, 1], devices=["cpu", "cpu"], chunks=2, schedule="interleaved",
        virtual_stages=2,
    )  # fmt: skip
    assert run(interleaved, looped) is interleaved
