"""The schedules benchmark end to end on its quick sizes: every (schedule, M) cell measured and
predicted, memory predicted exactly, and both timelines drawn. (Its accuracy is a measurement,
results/README.md, not a test: this machine is shared and noisy.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.support.scripts import load_script

CELL = re.compile(
    r"\| (gpipe|1f1b|interleaved|zb-h1|zb-v) \| (\d) \| (\d+) \| (\d+) \| [+-]\d+\.\d% "
    r"\| [\d.]+ \| [\d.]+ \| [\d.]+ \| (.+) \|"
)


def test_quick_run_fills_every_cell_and_draws_both_timelines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # main() in this process (one start-up of Python and torch less), on its command line's
    # argv; it sets two intra-op threads (one per worker): the count is put back after.
    benchmark = load_script("benchmarks/schedules_cpu.py")
    monkeypatch.setattr(sys, "argv", ["schedules_cpu.py", "--quick", "--out", str(tmp_path)])
    threads = torch.get_num_threads()
    try:
        benchmark.main()
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    cells = [m.groups() for m in map(CELL.match, stdout.splitlines()) if m]
    assert [(s, int(m)) for s, m, *_ in cells] == [
        (s, m) for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v") for m in (2, 4)
    ]
    for schedule, m, measured, predicted, memory in cells:
        assert int(measured) > 0 and int(predicted) > 0
        for worker in memory.split(", "):  # measured / predicted, per worker
            got, want = worker.split(" / ")
            assert got == want, (schedule, m, memory)
        for name in (f"{schedule}_k2_m{m}.png", f"{schedule}_k2_m{m}_measured.png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
