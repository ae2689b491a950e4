"""Option schemas are plain Python in modules that import no torch: the command line imports them
(no schema rebuilt from source), and a user's own option package, written as Python is written
(inheritance, a static helper, a class constant, a computed default, a relative import), runs and
has its values checked before torch is imported."""

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.train import HEAVY, REPO, environment, imported, train
from tests.timeouts import run

SCHEMA_MODULES = ["giantpipe.config", "models.options", "giantpipe.data.options", "giantpipe.cli"]
"""Where the schemas live (the core groups', the models', the data sets'), and the command line
that imports them; a module not (yet) there is left out."""


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", textwrap.dedent(code)]
    return run(command, 120, cwd=cwd, env=environment(), capture_output=True, text=True)


def test_importing_every_option_schema_module_imports_no_torch(tmp_path: Path):
    present = [m for m in SCHEMA_MODULES if importlib.util.find_spec(m) is not None]
    assert {"giantpipe.config", "models.options"} <= set(present)
    result = python(
        f"""
        import importlib, sys
        for name in {present!r}:
            importlib.import_module(name)
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"imported: {result.stdout}"


def test_registering_every_option_of_conf_imports_no_torch(tmp_path: Path):
    """Every model and data option of conf/ finds its schema in a torch-free module."""
    result = python(
        f"""
        import sys
        from pathlib import Path
        from giantpipe.cli.registration import OPTION_SCHEMAS, register_configs

        register_configs(Path({str(REPO / "conf")!r}))
        print(len(OPTION_SCHEMAS))
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    count, heavy = result.stdout.strip().splitlines()
    assert int(count) >= 10 and heavy == "[]", f"imported: {heavy}"


BASE = '''
"""What the user's model options share."""

from dataclasses import dataclass


@dataclass
class WidthConfig:
    width: int = 32
    """Hidden width."""
'''
SCHEMA = """
from dataclasses import dataclass

from .base import WidthConfig  # a relative import

DEPTHS = tuple(range(1, 9))  # a module constant that is not a literal


@dataclass
class WideModelConfig(WidthConfig):  # inherits the field width
    _target_: str = "userpkg.nets.wide"
    in_features: int = 16
    classes: int = 10
    depth: int = len(DEPTHS) // 4  # a computed default: 2
    MAX_WIDTH = 4096  # a class constant, not a field

    def __post_init__(self) -> None:
        self.check_range("model.depth", self.depth, 1, max(DEPTHS))
        self.check_range("model.width", self.width, 1, self.MAX_WIDTH)

    @staticmethod
    def check_range(key: str, value: int, low: int, high: int) -> None:
        if not low <= value <= high:
            raise ValueError(f"{key}: must be in [{low}, {high}], got {value}")
"""
BUILDER = """
from torch import nn


def wide(in_features=16, width=32, depth=2, classes=10):
    widths = [in_features] + [width] * depth
    blocks = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*blocks, nn.Linear(width, classes))
"""
OPTION = """
defaults:
  - WideModelConfig
  - _self_

_target_: userpkg.nets.wide
in_features: ${data.features}
classes: ${data.classes}
"""
LAYOUTS = {
    # the schema in the package's options.py (no torch there), the builder in nets.py
    "options": {"userpkg/options.py": SCHEMA, "userpkg/nets.py": BUILDER},
    # the schema beside its builder: found there too (importing the builder, and so torch)
    "beside": {"userpkg/nets.py": BUILDER + SCHEMA},
}


@pytest.fixture(params=list(LAYOUTS))
def user_checkout(request, tmp_path: Path) -> Path:
    """train.py and conf/ beside a user's own package ``userpkg`` and its option ``model=wide``,
    its schema in the package's options.py or beside the builder."""
    shutil.copy(REPO / "train.py", tmp_path / "train.py")
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    files = {"userpkg/__init__.py": "", "userpkg/base.py": BASE, "conf/model/wide.yaml": OPTION}
    for name, text in {**files, **LAYOUTS[request.param]}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip())
    (tmp_path / "layout").write_text(request.param)
    return tmp_path


def train_in(checkout: Path, *args: str, importtime: bool = False) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` of the user's ``checkout``, run there."""
    script = checkout / "train.py"
    return train(*args, cwd=checkout, script=script, importtime=importtime, timeout=300)


@pytest.mark.slow  # trains one step (imports torch)
def test_a_users_own_option_package_runs_with_a_valid_override(user_checkout: Path):
    result = train_in(
        user_checkout, "recipe=mlp_quickstart", "model=wide", "model.width=16", "model.depth=3",
        "trainer.max_steps=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = (user_checkout / "outputs").glob("*/*")
    config = (run_dir / "config.yaml").read_text()
    assert "_target_: userpkg.nets.wide" in config and "width: 16" in config


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model.depth=0"], "error: model.depth: must be in [1, 8], got 0"),  # the static helper
        (["model.width=5000"], "error: model.width: must be in [1, 4096], got 5000"),  # inherited
        (["model.widht=16"], "error: model.widht: unknown key"),
    ],
)
def test_a_users_own_option_refuses_a_bad_value_before_torch_is_imported(
    user_checkout: Path, args: list[str], expected: str
):
    result = train_in(user_checkout, "recipe=mlp_quickstart", "model=wide", *args, importtime=True)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert [line[: len(expected)] for line in lines] == [expected]
    if (user_checkout / "layout").read_text() == "options":
        assert not imported(result) & set(HEAVY), "the config was checked after importing torch"
    assert not (user_checkout / "outputs").exists()
