"""Generation with a Hugging Face Llama through the distributed pipe (gloo ranks on loopback):
its captured pieces keep key/value caches on their own rank, every rank gets the one-process
tokens (greedy and beam), and no rank keeps another stage's weights alive."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
from tests.support.ranks import spawn  # noqa: E402

pytestmark = pytest.mark.distributed


def test_two_ranks_decode_a_hugging_face_llama_as_one_process(tmp_path: Path) -> None:
    results = spawn(
        "tests.distributed.generate_hf_workers:decode",
        world=2,
        tmp=tmp_path,
        timeout=180,
        balance=[2, 3],
        chunks=2,
    )
    for result in results:
        assert result["got"] == result["alone"]
        assert result["alone"]["greedy"] != result["alone"]["beam"]
        assert 0 < result["held"] < result["total"]
        assert result["alive"] == result["held"]  # its stage's weights only, nothing more
    assert results[0]["held"] + results[1]["held"] == results[0]["total"]
