"""The schedules benchmark end to end on its quick sizes: every (schedule, M) cell measured and
predicted, memory predicted exactly, and both timelines drawn. (Its accuracy is a measurement,
results/README.md, not a test: this machine is shared and noisy.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CELL = re.compile(
    r"\| (gpipe|1f1b|interleaved|zb-h1) \| (\d) \| (\d+) \| (\d+) \| [+-]\d+\.\d% "
    r"\| [\d.]+ \| [\d.]+ \| [\d.]+ \| (.+) \|"
)


def test_quick_run_fills_every_cell_and_draws_both_timelines(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "schedules_cpu.py"), "--quick"]
    done = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cells = [m.groups() for m in map(CELL.match, done.stdout.splitlines()) if m]
    assert [(s, int(m)) for s, m, *_ in cells] == [
        (s, m) for s in ("gpipe", "1f1b", "interleaved", "zb-h1") for m in (2, 4)
    ]
    for schedule, m, measured, predicted, memory in cells:
        assert int(measured) > 0 and int(predicted) > 0
        for worker in memory.split(", "):  # measured / predicted, per worker
            got, want = worker.split(" / ")
            assert got == want, (schedule, m, memory)
        for name in (f"{schedule}_k2_m{m}.png", f"{schedule}_k2_m{m}_measured.png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
