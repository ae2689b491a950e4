"""A multirun ends with its table and plot in the sweep directory (the Hydra callback of
conf/config.yaml), and each job drew its loss curves beside its timelines."""

from __future__ import annotations

from pathlib import Path

from tests.support.runs import QUICK_MLP
from tests.support.train import ok, train


def test_a_two_job_multirun_writes_the_sweep_table_with_both_jobs(tmp_path: Path) -> None:
    result = ok(train("-m", *QUICK_MLP, "trainer.max_steps=2", "pipeline.chunks=1,2", cwd=tmp_path))
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    rows = (sweep_dir / "sweep.csv").read_text().splitlines()
    assert rows[0] == "job,pipeline.chunks,status,eval/loss"
    assert [r.split(",")[:3] for r in rows[1:]] == [
        ["0", "1", "completed"],
        ["1", "2", "completed"],
    ]
    assert all(float(r.split(",")[3]) > 0 for r in rows[1:])
    table = (sweep_dir / "sweep.md").read_text()
    assert "| job | pipeline.chunks | status | eval/loss |" in table and table in result.stdout
    assert (sweep_dir / "sweep.png").read_bytes().startswith(b"\x89PNG")
    for job in ("0", "1"):
        assert (sweep_dir / job / "curves.png").read_bytes().startswith(b"\x89PNG")
        assert (sweep_dir / job / "timeline_measured.png").is_file()  # beside the timelines
