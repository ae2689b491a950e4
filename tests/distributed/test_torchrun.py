"""Under torchrun: two "nodes" on one machine (two launches, c10d rendezvous, 1 process each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from giantpipe.testing import free_port
from tests.support.ranks import finish, rank_script, results_of, torchrun

pytestmark = pytest.mark.distributed


def test_two_nodes_with_c10d_rendezvous(tmp_path: Path) -> None:
    port = free_port()
    kwargs = {"workers": 2, "chunks": [3], "modes": ["except_last"], "schedules": ["gpipe", "1f1b"]}
    ranks = rank_script("tests.distributed.workers:equivalence", tmp_path, **kwargs)
    launches = [
        torchrun(
            [
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=giantpipe",
                "--max_restarts=0",
                *ranks,
            ]
        )
        for node in (0, 1)
    ]
    outputs = [finish(p, timeout=150) for p in launches]
    for code, output in outputs:
        assert code == 0, output
    for result in results_of(tmp_path, 2):
        assert {w.split(" ")[0] for w, _ in result["checked"]} == {"gpipe", "1f1b"}
