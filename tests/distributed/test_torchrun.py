"""Under torchrun: two "nodes" on one machine (two launches, c10d rendezvous, 1 process each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from giantpipe.testing import free_port
from tests.distributed.launch import REPO, finish, torchrun

pytestmark = pytest.mark.distributed


def test_two_nodes_with_c10d_rendezvous(tmp_path: Path) -> None:
    port = free_port()
    kwargs = json.dumps(
        {"workers": 2, "chunks": [3], "modes": ["except_last"], "schedules": ["gpipe", "1f1b"]}
    )
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
                str(REPO / "tests/distributed/torchrun_worker.py"),
                "equivalence",
                str(tmp_path),
                kwargs,
            ]
        )
        for node in (0, 1)
    ]
    outputs = [finish(p, timeout=150) for p in launches]
    for code, output in outputs:
        assert code == 0, output
    for rank in (0, 1):
        result = torch.load(tmp_path / f"result-{rank}.pt", weights_only=False)
        assert result["ok"], result.get("error")
        assert {w.split(" ")[0] for w, _ in result["result"]["checked"]} == {"gpipe", "1f1b"}
