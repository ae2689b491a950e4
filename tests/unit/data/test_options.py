"""The data options' schemas: checked up front, and importable without torch (the command line
checks a data value before torch is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from giantpipe.data.options import TextDataConfig

ROOT = Path(__file__).resolve().parents[3]


def test_importing_the_data_schemas_leaves_torch_out() -> None:
    code = (
        "import sys\n"
        "import giantpipe.data.options as options\n"
        "assert options.SyntheticDataConfig().batch_size == 64\n"
        "heavy = ('torch', 'torchvision', 'PIL', 'datasets', 'sentencepiece')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout  # torch (and the rest) never imported


def test_the_schema_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="data.valid_fraction"):
        TextDataConfig(files=["a.txt"], valid_fraction=1.0)
    with pytest.raises(ValueError, match="data.txt_documents"):
        TextDataConfig(files=["a.txt"], txt_documents="chapter")
