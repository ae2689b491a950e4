"""``recipes/generate.py`` answers at once: a bad argument, a missing run or a run that cannot
generate what is asked exits 2 with one line before torch is imported; a run directory means
its last/ checkpoint."""

from __future__ import annotations

import importlib.util
import resource
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.timeouts import run

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipes" / "generate.py"
HEAVY = ("torch", "hydra", "giantpipe", "transformers")


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The script's run with ``-X importtime``, and the CPU seconds it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command = [sys.executable, "-X", "importtime", str(SCRIPT), *args]
    done = run(command, 60, cwd=cwd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def a_run(folder: Path, model: str = "models.transformer_lm.transformer_lm", **data) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": {"_target_": model}, **data}))
    return folder


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["RUN", "--prompt=5", "--max-new=0"], "error: --max-new must be >= 1, got 0"),
        (["RUN", "--prompt=5", "--top-p=2"], "error: --top-p must be in (0, 1], got 2.0"),
        (["RUN"], "error: give --prompt"),
        (["nowhere", "--prompt=5"], "error: nowhere: no such run or checkpoint"),
        (["EMPTY", "--prompt=5"], "error: EMPTY: the run has no last/ checkpoint (it saved none)"),
        (["RUN", "--prompt=5"], "error: a translation model needs --to LANG"),
        (["TOKENS", "--text=a fox"], "error: --text: this run (giantpipe.data.lm_tokens.lm_tok"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_torch_is_imported(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    translation = a_run(tmp_path / "RUN", model="models.transformer.transformer_t")
    (translation / "last").mkdir()
    a_run(tmp_path / "EMPTY")
    tokens = a_run(tmp_path / "TOKENS", data={"_target_": "giantpipe.data.lm_tokens.lm_tokens"})
    (tokens / "last").mkdir()
    done, cpu_s = generate(*args, cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert errors[0].startswith(expected)
    imported = {line.rpartition("|")[2].strip().split(".")[0] for line in done.stderr.splitlines()}
    assert imported.isdisjoint(HEAVY)
    assert cpu_s < 1.0  # Python and yaml; torch alone takes seconds


def test_a_run_directory_means_its_last_checkpoint(tmp_path: Path) -> None:
    find = script().checkpoint_of
    run = a_run(tmp_path / "run")
    (run / "last").mkdir()
    (run / "step_5").mkdir()
    (tmp_path / "model.pt").write_bytes(b"")
    assert find(run) == run / "last"
    for given in (run / "last", run / "step_5", tmp_path / "model.pt"):
        assert find(given) == given


def test_a_run_without_last_names_its_newest_step(tmp_path: Path, capsys) -> None:
    run = a_run(tmp_path / "run")
    for step in (5, 10, 40):
        (run / f"step_{step}").mkdir()
    with pytest.raises(SystemExit) as stop:
        script().checkpoint_of(run)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {run}: the run has no last/ checkpoint (give one of its checkpoints, e.g. "
        f"{run / 'step_40'})\n"
    )
