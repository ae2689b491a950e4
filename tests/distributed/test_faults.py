"""Failures: every rank stops within the timeout, naming the rank and stage that failed first;
no process is left behind; the last checkpoint is intact and consolidates."""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import pytest
import torch

from giantpipe.checkpoint.export import consolidate
from tests.support.ranks import finish, rank_records, rank_script, start_ranks, torchrun

pytestmark = pytest.mark.distributed

TIMEOUT = 5.0  # the pipeline's timeout in these tests (default 60 s)


def assert_checkpoint_intact(tmp: Path, workers: int) -> None:
    """The checkpoint saved before the failure consolidates to what replica 0's ranks (which
    write it) held then."""
    expected = {}
    for r in range(workers):
        expected.update(torch.load(tmp / f"expected-{r}.pt", weights_only=True))
    out = tmp / "consolidated.pt"
    consolidate(tmp / "ckpt", out)
    merged = torch.load(out, weights_only=True)
    assert merged.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(merged[name], value), name
    assert not list((tmp / "ckpt").glob(".*tmp*"))  # no half-written file


FIRST_RAISED = r"^rank 1 \(stage 1\) failed on micro-batch \d+: ValueError: injected failure"
FIRST_KILLED = r"^rank 1 \(stage 1\) is gone"  # whatever the survivor itself ran into
SILENT = r"timed out after 5s waiting for the \w+ of micro-batch \d+ from rank 1 \(stage 1\)"


@pytest.mark.parametrize(
    ("how", "world", "workers", "expected"),
    [
        ("raise", 3, 3, FIRST_RAISED),
        ("hang", 3, 3, SILENT),
        ("kill", 3, 3, FIRST_KILLED),
        # R = 2: rank 3 (stage 1 of replica 1) meets rank 1's death in the gradient all-reduce,
        # rank 2 only through rank 3 or rank 0; every one names rank 1 first.
        ("kill", 4, 2, FIRST_KILLED),
        ("raise", 4, 2, FIRST_RAISED),
    ],
)
def test_a_failing_killed_or_silent_rank_is_named_by_every_rank(
    tmp_path: Path, how: str, world: int, workers: int, expected: str
):
    procs = start_ranks(
        "tests.distributed.workers:faulty",
        world,
        tmp_path,
        workers=workers,
        fail_rank=1,
        how=how,
        timeout=TIMEOUT,
    )
    survivors = [r for r in range(world) if r != 1]
    deadline = time.monotonic() + 90
    try:
        for r in survivors:
            procs[r].join(max(0.0, deadline - time.monotonic()))
        running = [r for r in survivors if procs[r].is_alive()]
        assert not running, (
            f"ranks {running} still running; results: {rank_records(tmp_path, world)}"
        )
        procs[1].join(30 if how == "raise" else 0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    got = rank_records(tmp_path, world)
    for r in survivors + ([1] if how == "raise" else []):
        assert got[r]["ok"], got[r].get("error")
        failure = got[r]["result"]["failure"]
        assert failure is not None
        assert re.search(expected, failure), f"rank {r}: {failure}"
        assert got[r]["result"]["after_s"] < TIMEOUT + 10, failure
    assert_checkpoint_intact(tmp_path, workers)


def test_a_transfer_aborted_after_its_stream_wait_fails_the_step_on_every_rank(
    tmp_path: Path,
) -> None:
    """NCCL's watchdog aborting a payload receive before the step's device wait ends (issue
    32, item 6): train_step returns nothing on either rank, and both name the aborted transfer
    and its peer (tests/distributed/aborted_workers.py stands NCCL's answers in on gloo)."""
    from tests.support.ranks import spawn

    got = spawn("tests.distributed.aborted_workers:aborted_receive", world=2, tmp=tmp_path)
    first = (
        "rank 1 (stage 1): receiving the activation of micro-batch 0 from rank 0 (stage 0) "
        "was aborted (communicator torn down)"
    )
    assert [r["returned"] for r in got] == ["nothing", "nothing"]
    assert got[1]["raised"] == first
    assert got[0]["raised"].startswith(first)  # rank 0 is told the first failure


def _processes_with(marker: str) -> list[int]:
    """PIDs whose environment holds ``marker`` (the processes one launch started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_sigkill_under_torchrun_stops_all_and_leaves_no_process(tmp_path: Path) -> None:
    marker = f"GIANTPIPE_TEST_RUN={uuid.uuid4().hex}"
    kwargs = {"workers": 3, "fail_rank": 1, "how": "kill", "timeout": TIMEOUT}
    start = time.monotonic()
    proc = torchrun(
        [
            "--standalone",
            "--nproc_per_node=3",
            "--max_restarts=0",
            *rank_script("tests.distributed.workers:faulty", tmp_path, **kwargs),
        ],
        env=dict([marker.split("=")]),
    )
    code, output = finish(proc, timeout=120)
    elapsed = time.monotonic() - start
    assert code != 0, output
    # Each survivor either returned the failure or was stopped by torchrun and said why.
    returned = rank_records(tmp_path, 3)
    for r in (0, 2):
        if r in returned and returned[r].get("ok"):
            assert re.search(FIRST_KILLED, returned[r]["result"]["failure"]), returned[r]
        else:
            note = f"giantpipe rank {r} (stage {r}): stopped by SIGTERM; first failure: "
            assert note + "rank 1 (stage 1) is gone" in output, output
    assert elapsed < 90, output
    time.sleep(0.5)
    assert _processes_with(marker) == [], "processes left behind"
    assert_checkpoint_intact(tmp_path, 3)
