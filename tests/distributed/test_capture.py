"""A sequentialized Hugging Face model under the distributed executor (gloo processes): every
schedule and re-materialization mode at K=2, K=4 processes, dropout masks replayed; gradients
equal the original module's by its own parameter names."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launch import spawn

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

MODES = ["always", "except_last", "never"]
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved"]


def test_gpt2_two_processes_every_schedule_and_mode(tmp_path: Path) -> None:
    cases = [(s, 4, mode) for s in SCHEDULES for mode in MODES]
    results = spawn(
        "tests.distributed.capture_workers:gpt2_equals_the_original",
        world=2,
        tmp=tmp_path,
        timeout=400,
        workers=2,
        cases=cases,
    )
    for rank in results:
        assert len(rank["checked"]) == len(cases)
        assert all(n > 0 for _, n in rank["checked"])  # every rank compared its parameters


def test_gpt2_four_processes(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.capture_workers:gpt2_equals_the_original",
        world=4,
        tmp=tmp_path,
        timeout=400,
        workers=4,
        cases=[("1f1b", 4, "except_last")],
    )
    assert all(rank["checked"][0][1] > 0 for rank in results)


def test_gpt2_dropout_masks_are_replayed_across_processes(tmp_path: Path) -> None:
    spawn(
        "tests.distributed.capture_workers:gpt2_dropout_replayed",
        world=2,
        tmp=tmp_path,
        timeout=400,
        workers=2,
        modes=MODES,
    )
