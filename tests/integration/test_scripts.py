"""Every script under recipes/ and benchmarks/ runs as the docs type it, in the README's venv
(the installed package, no PYTHONPATH, from the repository's root), and writes to outputs/ unless
asked to update results/ (issue 32, item 8)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    path.relative_to(REPO).as_posix()
    for folder in ("recipes", "benchmarks")
    for path in (REPO / folder).glob("*.py")
    if 'if __name__ == "__main__"' in path.read_text()
)
"""The scripts (the other files there are modules they import)."""


def as_typed() -> dict[str, str]:
    """The environment of a user's shell in the README's venv: no PYTHONPATH."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_every_script_answers_help_as_typed() -> None:
    """`python recipes/generate.py ...` stopped with `No module named 'models'` unless
    PYTHONPATH=. was set: every script puts its checkout's models/ (and src/) on sys.path. And
    each answers `--help` and refuses a bad argument before it imports torch (1.5 s of CPU each;
    the scripts' tests took 50 s of CI for it)."""
    assert len(SCRIPTS) >= 20
    runs = [(script, flag) for script in SCRIPTS for flag in ("--help", "--no-such-option")]
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(runs, pool.map(lambda run: probe(*run), runs), strict=True))
    models = f"models/ from {REPO / 'models'}"
    failed = {
        f"{script} {flag}": out[-600:]
        for (script, flag), (code, out) in done.items()
        if code != (0 if flag == "--help" else 2)
        or "usage:" not in out
        or "torch imported: False" not in out
        or models not in out
    }
    assert failed == {}


PROBE = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python SCRIPT` puts first
try:
    runpy.run_path(script, run_name="__main__")
finally:  # --help exits; by then the script must have found its checkout's models/ itself
    print("torch imported:", "torch" in sys.modules)
    import models
    print("models/ from", os.path.dirname(models.__file__))
"""
"""``python SCRIPT FLAG``; then whether torch was imported, and ``import models``, in the same
interpreter: --help alone imports no model, and the configs' ``_target_`` reach models/ later."""


def probe(script: str, flag: str) -> tuple[int, str]:
    """:data:`PROBE` on ``script`` from the repository's root: exit status and output."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, script, flag],
        cwd=REPO,
        env={**as_typed(), "OMP_NUM_THREADS": "1"},  # benchmarks/peers.py restarts without it
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout


def test_generate_decodes_a_run_as_typed(tmp_path: Path) -> None:
    """--help alone imports no model: the recipe rebuilds the run's model from its config's
    `_target_` (models.transformer_lm), which needs the checkout's models/."""
    from models.transformer import transformer_lm

    model = {"num_layers": 1, "d_model": 8, "ffn_dim": 16, "num_heads": 2, "vocab_size": 20}
    target = {"_target_": "models.transformer_lm.transformer_lm", **model, "max_len": 16}
    torch.save(transformer_lm(**model, max_len=16).state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": target}))
    command = ["recipes/generate.py", str(tmp_path / "model.pt"), "--prompt=3 4", "--max-new=2"]
    done = subprocess.run(
        [sys.executable, *command], cwd=REPO, env=as_typed(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("3 4 -> ")


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_script_writes_outputs_unless_asked_to_update_results(tmp_path: Path) -> None:
    """`python recipes/table2_throughput.py --device p40` (and Table 1, the transparency and
    peers benchmarks) rewrote the tracked files under results/ that the docs cite."""
    before = fingerprint(REPO / "results")
    command = [sys.executable, str(REPO / "recipes" / "table2_throughput.py"), "--quick"]
    command += ["--device-only", "--only", "transformer_t3"]
    done = subprocess.run(command, cwd=tmp_path, env=as_typed(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "outputs" / "table2").iterdir()) == [
        "device.md",
        "device.png",
    ]
    assert fingerprint(REPO / "results") == before
    usage = subprocess.run([*command[:2], "--help"], capture_output=True, text=True).stdout
    assert "--update-results" in usage and "results/table2" in usage
