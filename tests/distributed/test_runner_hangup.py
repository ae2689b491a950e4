"""Issue 22, item 7 under torchrun: a dropped SSH session (SIGHUP to the terminal's process
group: torchrun and its ranks) saves every rank's shard of one agreed step, like SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.metrics.jsonl import read_jsonl
from tests.support.ranks import finish
from tests.support.train import train_under_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MLP = [
    "recipe=mlp_quickstart",
    "data.train_size=512",
    "data.eval_size=128",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.predict=false",
    "logger.progress=none",
]


def test_a_hangup_under_torchrun_saves_every_shard(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train_under_torchrun(run, *MLP, "trainer.max_steps=5000")
    deadline = time.monotonic() + 180
    metrics = run / "metrics.jsonl"
    while len(read_jsonl(metrics) if metrics.exists() else []) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc, 1)[1][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGHUP)  # the terminal hangs up: torchrun and every rank
    _, output = finish(proc, timeout=90)
    stopped = json.loads((run / "summary.json").read_text())
    assert stopped["status"] == "hangup", output[-3000:]
    saved = read_checkpoint(run / "last")  # committed once both ranks wrote their part
    assert saved["step"] == stopped["steps"] >= 3 and saved["workers"] == 2
