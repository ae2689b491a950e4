"""A sequentialized Hugging Face GPT-2 under the distributed executor (two gloo processes, one
start for every case: starting processes and capturing the model is what costs here): every
schedule and every re-materialization mode, dropout on, so masks must be replayed across
processes; the pipeline equals the sequentialized model run micro-batch by micro-batch, and each
rank's state has the original model's parameter names. The tied embedding is held by the first
and the last rank: its gradient is the sum of both uses on each, counted once in the norm.
(The sequentialized model equals the original, K up to 4: test_capture_models.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import spawn

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

# (schedule, M, checkpoint): every schedule and every mode
CASES = [
    ("gpipe", 4, "always"),
    ("1f1b", 4, "except_last"),
    ("zb-h1", 4, "never"),
    ("interleaved", 4, "except_last"),
]


def test_gpt2_two_processes_every_schedule_and_mode_dropout_replayed(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.capture_workers:gpt2_equals_the_sequentialized",
        world=2,
        tmp=tmp_path,
        timeout=400,
        workers=2,
        cases=CASES,
    )
    for rank in results:
        assert [name for name, _ in rank["checked"]] == [f"{s} M={m} {c}" for s, m, c in CASES]
        assert all(n > 0 for _, n in rank["checked"])  # every rank compared its parameters
