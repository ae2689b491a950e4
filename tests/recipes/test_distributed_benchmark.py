"""The distributed benchmark end to end on its quick sizes: both models, every method at every
M it runs at, and the best-against-best table. (Its figures are measurements, results/README.md,
not a test: this machine is shared and noisy.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from giantpipe.engine.schedules import schedule_builders
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
BEST = re.compile(
    r"\| (\d+) \| \d+ \| ([\w-]+) \d+ \| ([\w-]+) \d+ \| [\d.]+x \| [\d.]+x \| [\d.]+ \| [\d.]+ \|"
)


SCRIPT = ROOT / "benchmarks" / "distributed_cpu.py"


def test_quick_run_compares_both_models_best_against_best(tmp_path: Path) -> None:
    figure = tmp_path / "run.png"
    command = [sys.executable, str(SCRIPT), "--quick", "--plot", str(figure)]
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
    assert figure.stat().st_size > 10_000  # both models' panels
    # the figure is drawn from the printed tables: every method's fraction at every M
    panels = load_script("benchmarks/distributed_cpu.py").parse_fractions(out)
    assert [label.split(" x ")[0] for label, _ in panels] == ["FFN 4", "MLP 4"]
    for _, fractions in panels:
        assert {m for per in fractions.values() for m in per} == {1, 4}
        assert fractions["gp-dist-gpipe"].keys() == {1, 4} and 4 in fractions["pippy-zbv"]


def test_replot_draws_runs_printed_before_and_names_what_it_cannot_read(tmp_path: Path) -> None:
    saved = tmp_path / "run.txt"
    saved.write_text(
        "MLP 8 x Linear(1024) + ReLU, batch 512, K=2 gloo processes x 1 thread, checkpoint "
        "never; median of 7 rounds; samples/s (fraction of bound)\n\n"
        "| M | plain-mb 1 core | bound | gp-dist-1f1b | pippy-1f1b |\n|---|---|---|---|---|\n"
        "| 1 | 670 | 670 | 670 (1.00) | - |\n| 4 | 620 | 992 | 933 (0.94) | 931 (0.94) |\n"
    )
    figure = tmp_path / "fig.png"

    def replot(*paths: Path) -> subprocess.CompletedProcess:
        command = [sys.executable, str(SCRIPT), "--replot", *map(str, paths), "--plot", str(figure)]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)

    done = replot(saved)
    assert done.returncode == 0, done.stderr
    assert figure.stat().st_size > 10_000
    figure.unlink()
    missing = replot(saved, tmp_path / "nothere.txt")
    assert missing.returncode == 2 and "no such file: " in missing.stderr
    assert str(tmp_path / "nothere.txt") in missing.stderr and not figure.exists()
    empty = tmp_path / "empty.txt"
    empty.write_text("nothing printed here\n")
    none = replot(empty)
    assert none.returncode == 2 and "no table of a run in" in none.stderr
