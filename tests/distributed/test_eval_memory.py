"""Held-out BLEU under torchrun keeps rank 0 to its own stages (issue 23): after a tiny
translation run's final evaluation through the runner, rank 0's live parameters are its stages'
share and its live tensor bytes are its stages' weights, gradients and optimizer state plus a
small bound; BLEU equals the one-process figure. With GPipe's schedule and with an interleaved
one (V = 2 stages per rank, decoding round the ranks twice per token)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.eval_memory_workers import run
from tests.support.ranks import spawn

pytestmark = pytest.mark.distributed

OTHER_BYTES = 64 * 1024
"""What a rank may hold beyond its training state: data (token ids of a few hundred sentences),
position tables, messages in flight. A quarter of the whole model's weights (about 110 KB here,
half of what a rank keeping a whole copy would add) is well above it."""

SCHEDULES = {
    "gpipe": [],
    "interleaved": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("local")
    return run(tmp, str(tmp / "run"), "local", [])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_rank_0_holds_only_its_stages_after_held_out_bleu(
    schedule: str, one_process: dict, tmp_path: Path
) -> None:
    ranks = spawn(
        "tests.distributed.eval_memory_workers:run",
        world=2,
        tmp=tmp_path,
        timeout=240,
        run_dir=str(tmp_path / "run"),
        executor="distributed",
        overrides=SCHEDULES[schedule],
    )
    first = ranks[0]
    assert first["live_params"] == first["params"]  # its stages' share, nothing else
    assert sum(r["params"] for r in ranks) == one_process["params"]
    assert 0 < first["params"] < one_process["params"]
    training = first["weights"] + first["grads"] + first["optimizer"]
    assert first["optimizer"] > 0 and first["grads"] > 0  # trained: the state is there
    assert first["live_bytes"] <= training + OTHER_BYTES, (first, one_process)
    assert OTHER_BYTES < one_process["weights"] / 4
    assert not first["kept_model"]
    for r in ranks:
        assert r["bleu"] == pytest.approx(one_process["bleu"], rel=1e-6)
