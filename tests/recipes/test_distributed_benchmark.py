"""The distributed benchmark end to end on its quick sizes: both models, every method at every
M it runs at, and the best-against-best table. (Its figures are measurements, results/README.md,
not a test: this machine is shared and noisy.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from giantpipe.engine.schedules import schedule_builders

ROOT = Path(__file__).resolve().parents[2]
BEST = re.compile(
    r"\| (\d+) \| \d+ \| ([\w-]+) \d+ \| ([\w-]+) \d+ \| [\d.]+x \| [\d.]+x \| [\d.]+ \| [\d.]+ \|"
)


def test_quick_run_compares_both_models_best_against_best() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "distributed_cpu.py"), "--quick"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "FFN 4 x (LayerNorm" in out and "MLP 4 x Linear(64)" in out
    best = [m.groups() for m in map(BEST.match, out.splitlines()) if m]
    assert [int(m) for m, _, _ in best] == [1, 4, 1, 4]  # per model, per M
    ours = set(schedule_builders())  # every registered schedule runs on 2 workers
    theirs = {"gpipe", "1f1b", "interleaved", "zbv"}
    assert all(gp in ours and pp in theirs for _, gp, pp in best)
    assert "| 4 | " in out and "pippy-zbv" in out and "gp-dist-zb-h1" in out
