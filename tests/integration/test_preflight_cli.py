"""``python train.py`` sizes a run before it allocates: a recipe that cannot fit is refused in one
line (exit 2, the keys named, nothing written, its model never allocated), and
``trainer.dry_run=true`` prints the plan, the memory per device and the step time, then exits 0
without training or saving."""

import subprocess
import sys
from pathlib import Path

import pytest

from giantpipe.runner.preflight import GIB, host_available
from tests.support.train import command, environment
from tests.timeouts import run

pytestmark = pytest.mark.slow  # python train.py end to end (torch, a 2.5B model sized on meta)

REPO = Path(__file__).resolve().parents[2]
# Runs the command and prints, last, its peak resident memory (KiB) and CPU seconds.
MEASURED = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "use = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print(f'measured {use.ru_maxrss} {use.ru_utime + use.ru_stime}', flush=True)\n"
    "sys.exit(code)\n"
)


def train(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, int, float]:
    """The run, its peak resident bytes and its CPU seconds."""
    measured = [sys.executable, "-c", MEASURED, *command(*args)]
    result = run(measured, 240, cwd=cwd, env=environment(), capture_output=True, text=True)
    _, rss, cpu = result.stdout.splitlines()[-1].split()
    return result, int(rss) * 1024, float(cpu)


def refused_at_once(result: subprocess.CompletedProcess, rss: int, cwd: Path) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    # the model (2.5B parameters: 10 GB of weights alone) was never allocated
    assert rss < 3 * GIB, f"peak resident {rss / GIB:.1f} GiB: something was allocated"
    assert not (cwd / "outputs").exists()  # nothing written
    return line


def test_a_recipe_over_its_budget_is_refused_in_one_line_naming_the_keys(tmp_path: Path):
    # 16 GiB per device (the paper's TPU cores): deterministic on any machine
    result, rss, cpu = train(
        "recipe=transformer_lm_scaling", "pipeline.memory_budget_gib=16", cwd=tmp_path
    )
    line = refused_at_once(result, rss, tmp_path)
    assert line.startswith(
        "error: pipeline.memory_budget_gib: recipe transformer_lm_scaling does not fit: "
        "2 devices of pipeline.memory_budget_gib=16; the step is predicted to need 24"
    )
    assert "predicted to fit with pipeline.num_devices=4" in line
    assert cpu < 60, f"{cpu:.0f} CPU seconds to refuse"  # a few on an idle core


@pytest.mark.skipif(host_available() > 40 * GIB, reason="a host that may hold the 2.5B model")
def test_the_big_recipe_on_this_host_is_refused_naming_its_hardware(tmp_path: Path):
    result, rss, _ = train("recipe=transformer_lm_scaling", cwd=tmp_path)
    line = refused_at_once(result, rss, tmp_path)
    assert line.startswith("error: pipeline: recipe transformer_lm_scaling does not fit: 2 ")
    assert "of available host memory; the step is predicted to need" in line
    assert "pipeline.num_devices, pipeline.chunks, pipeline.recompute" in line
    assert "it wants 2 devices of at least 24" in line


def test_dry_run_prints_the_plan_and_forecast_and_trains_nothing(tmp_path: Path):
    run_dir = tmp_path / "run"
    result, _, _ = train(
        "recipe=mlp_quickstart", "trainer.dry_run=true", f"hydra.run.dir={run_dir}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "dry run of mlp_quickstart: forecast on the meta device" in out
    assert "  plan       K=2, balance [" in out and "schedule gpipe, M=" in out
    assert "  memory     peak per device " in out and ": fits" in out
    assert "  step time  " in out and "samples/s" in out
    kept = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert kept in ([], ["train.log"])  # no checkpoint, no metrics, no summary
