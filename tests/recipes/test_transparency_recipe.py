"""Transparency recipe: its plain reference takes the engine's step exactly, its grid covers
every schedule that runs, and the quick run finds the pipelined runs equal to the plain ones."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from giantpipe.data.bundle import DataBundle
from giantpipe.engine import GPipe
from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    return load_script("recipes/transparency.py")


def test_grid_has_plain_per_m_and_every_schedule_that_runs(recipe: ModuleType) -> None:
    cells = ((2, 2), (2, 4), (4, 2), (4, 4))
    setup = recipe.Setup("x", "x", "amoebanet_quickstart", (), steps=1, cells=cells)
    labels = [c.label for c in recipe.configs(setup)]
    assert labels[:4] == [
        "plain, M=2",
        "plain fill-drain, M=2",
        "plain, M=4",
        "plain fill-drain, M=4",
    ]
    for k, m in [(2, 2), (2, 4), (4, 4)]:
        for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1"):
            assert f"{schedule}, K={k}, M={m}" in labels
    assert "interleaved, K=4, M=2" not in labels  # interleaved needs M divisible by K
    gpipe, zero_bubble = recipe.Config(2, 4, "gpipe"), recipe.Config(2, 4, "zb-h1")
    assert gpipe.reference.label == "plain fill-drain, M=4"  # backwards last-in first-out
    assert zero_bubble.reference.label == "plain, M=4"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3)
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Kernels split their sums by thread count: one thread for plain and each stage alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.usefixtures("one_thread")
def test_plain_step_takes_the_pipeline_step_exactly(recipe: ModuleType, schedule: str) -> None:
    bundle = DataBundle(train_batches=lambda s, p: iter(()), eval_batches=list, batches_per_epoch=1)
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    loss_fn = nn.functional.cross_entropy
    plain = _model()
    pipe = GPipe(copy.deepcopy(plain), [3, 2], devices=["cpu", "cpu"], chunks=3,
                 checkpoint="except_last", deferred_batch_norm=True, schedule=schedule,
                 threads_per_worker=1)  # fmt: skip
    recipe.convert_deferred_batch_norm(plain)
    recipe.install_rng_hooks(plain)
    torch.manual_seed(7)
    expected = recipe.pipe_step(pipe, bundle, loss_fn)(x, y)
    torch.manual_seed(7)  # the plain step draws its dropout seed as the engine does
    fill_drain = recipe.Config(2, 3, schedule).reference.schedule == "plain fill-drain"
    got = recipe.plain_step(plain, bundle, loss_fn, 3, fill_drain)(x, y)
    assert got == expected  # the same additions in the same order: the same bits
    for (name, a), (_, b) in zip(plain.named_parameters(), pipe.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    for name, buffer in plain.named_buffers():  # running statistics committed once
        torch.testing.assert_close(buffer, dict(pipe.named_buffers())[name], msg=name)


@pytest.mark.slow
def test_quick_run_finds_every_pipelined_run_equal_to_plain(
    recipe: ModuleType, tmp_path: Path
) -> None:
    # main() in this process (one start-up of Python and torch less; the command line adds
    # nothing but argv). It sets one intra-op thread for all its runs: put the count back.
    threads = torch.get_num_threads()
    try:
        assert recipe.main(["--quick", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "transparency.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| [\w-]+, K=\d", line)]
    assert len(rows) == 2 * 4  # two models x four schedules at K=2, M=2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        dloss, dparam = float(cells[4]), float(cells[5])
        assert dloss == 0.0 and dparam == 0.0, row  # bit for bit
    assert "BLEU" in text and "acc" in text
    assert (tmp_path / "transparency.png").stat().st_size > 10_000
