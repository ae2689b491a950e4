"""The tests share their tools (tests/support/): no test module is imported as a library, the
everyday lane imports nothing from the slow folders, ranks are started by one launcher
(tests/support/ranks.py) and ``python train.py`` run by one helper (tests/support/train.py).

Imports are read from the source (``ast``), lazy ones and spawn targets (``"module:function"``)
included.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.conftest import SLOW_DIRS

TESTS = Path(__file__).resolve().parents[1]
SUPPORT = "support/"
GUARD = "unit/test_test_tools.py"  # this file: its example sources hold the words it bans

LAUNCHING_MODULES = ("multiprocessing", "torch.multiprocessing", "torch.distributed.run",
                     "torch.distributed.launcher", "torch.distributed.elastic")  # fmt: skip
LAUNCHING_WORDS = ("torchrun", "torch.distributed.run")
"""A command word that starts ranks (``subprocess.Popen(["torchrun", ...])``)."""

TARGET = re.compile(r"^(tests(?:\.\w+)+):\w+$")
"""A spawn target, ``"tests.distributed.workers:equivalence"``: imported by each rank."""

Finding = tuple[str, str, str]  # file, the rule it breaks, what


@functools.cache
def module_path(name: str) -> str | None:
    """The file (relative to tests/) of module ``name``, if it is one of tests/."""
    parts = name.split(".")[1:]
    if not parts:
        return None
    for candidate in (Path(*parts).with_suffix(".py"), Path(*parts, "__init__.py")):
        if (TESTS / candidate).is_file():
            return candidate.as_posix()
    return None


def imported(tree: ast.AST) -> set[str]:
    """The files of tests/ a module imports: ``import``, ``from``, lazy ones, spawn targets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            target = TARGET.match(node.value)
            names.update([target.group(1)] if target else [])
    paths = {module_path(name) for name in names if name.split(".")[0] == "tests"}
    return {path for path in paths if path is not None}


def runs_train_py(tree: ast.AST) -> bool:
    """Whether a module builds a command list holding both ``sys.executable`` and a
    ``train.py``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            words = [ast.unparse(element) for element in node.elts]
            if "sys.executable" in words and any("train.py" in word for word in words):
                return True
    return False


def launches(tree: ast.AST) -> set[str]:
    """What a module starts ranks with: a launching module it imports, a torchrun command word."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(LAUNCHING_MODULES))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(LAUNCHING_MODULES):
            found.add(node.module or "")
        elif isinstance(node, ast.Constant) and node.value in LAUNCHING_WORDS:
            found.add(repr(node.value))
    return found


def findings(path: str, source: str) -> set[Finding]:
    """Every rule module ``path`` (relative to tests/) with ``source`` breaks."""
    tree = ast.parse(source)
    slow = path.split("/")[0] in SLOW_DIRS
    out: set[Finding] = set()
    for target in imported(tree):
        if Path(target).name.startswith("test_") and target != path:
            out.add((path, "test module", target))
        if not slow and target.split("/")[0] in SLOW_DIRS:
            out.add((path, "slow folder", target))
    if not path.startswith(SUPPORT):
        out.update((path, "launches", what) for what in launches(tree))
        if runs_train_py(tree):
            out.add((path, "runs train.py", "python train.py"))
    return out


def all_findings() -> set[Finding]:
    found: set[Finding] = set()
    for file in sorted(TESTS.rglob("*.py")):
        path = file.relative_to(TESTS).as_posix()
        if path != GUARD:
            found |= findings(path, file.read_text())
    return found


def test_the_tests_share_their_tools() -> None:
    broken = sorted(all_findings())
    assert not broken, (
        "move the shared tool to tests/support/ and import it from there:\n"
        + "\n".join(map(str, broken))
    )


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("unit/a/test_x.py", "from tests.unit.runner.test_runner_loop import tiny",
         {("unit/a/test_x.py", "test module", "unit/runner/test_runner_loop.py")}),
        ("unit/a/test_x.py", "def f():\n    from tests.unit.engine import test_generate",
         {("unit/a/test_x.py", "test module", "unit/engine/test_generate.py")}),
        ("unit/a/test_x.py", "from tests.support.runs import tiny", set()),
        ("unit/a/x_workers.py", "import tests.distributed.workers",
         {("unit/a/x_workers.py", "slow folder", "distributed/workers.py")}),
        ("unit/a/test_x.py", "spawn('tests.distributed.workers:faulty', world=2, tmp=t)",
         {("unit/a/test_x.py", "slow folder", "distributed/workers.py")}),
        ("distributed/test_x.py", "from tests.distributed.workers import shard", set()),
        ("unit/a/test_x.py", "import torch.multiprocessing as mp",
         {("unit/a/test_x.py", "launches", "torch.multiprocessing")}),
        ("integration/test_x.py", "Popen(['torchrun', '--standalone', 'train.py'])",
         {("integration/test_x.py", "launches", "'torchrun'")}),
        ("integration/test_x.py", "run([sys.executable, str(REPO / 'train.py'), *args])",
         {("integration/test_x.py", "runs train.py", "python train.py")}),
        ("integration/test_x.py", '"""Runs ``torchrun train.py``."""\ntrain("x", cwd=d)', set()),
        ("support/ranks.py", "import torch.multiprocessing as mp", set()),
    ],
)  # fmt: skip
def test_each_rule_is_read_from_the_source(path: str, source: str, expected: set) -> None:
    assert findings(path, source) == expected
