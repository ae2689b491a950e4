"""Docs that run: every code block of README.md and docs/*.md runs as printed.

A ```python block runs as a script, a ```bash block with bash (``set -e``), each in a fresh copy
of the repository's scripts and configs (so a block that writes ``models/wide.py`` or
``outputs/`` leaves the checkout alone). Runs are shortened only as docs/running.md says a user
shortens them: ``trainer.max_steps=2`` appended to a ``train.py`` command that sets no
``trainer.max_steps`` of its own, ``--quick`` appended to a benchmark or recipe script. A
```yaml or ```text block is a file or an output shown, not run. A block opts out only with
``<!-- not-run: reason -->`` on the line before it. What a block writes lands under
``outputs/``, never beside the checkout's own files.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "results" / "README.md"  # measured figures: linked to, and checked for links
RUN = ("python", "bash")
SHOWN = ("yaml", "text")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not-run: (\S.*?) -->[ \t]*\n\Z")
MAX_NOT_RUN = 10  # opting out is for what cannot run here (a cluster, a GPU, the suite itself)
COPIED = ("train.py", "conf", "models", "recipes", "benchmarks", "pyproject.toml")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a doc file."""

    path: Path
    line: int
    lang: str
    code: str
    not_run: str | None  # the reason given by a <!-- not-run: ... --> marker

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, in order, each with its line and opt-out reason."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        marker = NOT_RUN.search(before)
        found.append(
            Block(
                path,
                before.count("\n") + 1,
                match.group(1),
                match.group(2),
                marker.group(1) if marker else None,
            )
        )
    return found


def shortened(line: str) -> str:
    """``line`` as docs/running.md says to shorten it: two steps, or a script's --quick mode."""
    command, comment = re.match(r"(.*?)(\s+#\s.*)?$", line).groups()  # type: ignore[union-attr]
    words = command.split()
    if "train.py" in words and not any(w.startswith("trainer.max_steps=") for w in words):
        command += " trainer.max_steps=2"
    elif (script := re.match(r"python ((benchmarks|recipes)/\w+\.py)", command)) and (
        "--quick" not in words and has_quick(script.group(1))
    ):
        command += " --quick"
    return command + (comment or "")


def has_quick(script: str) -> bool:
    """Whether a script under benchmarks/ or recipes/ has a --quick mode."""
    return '"--quick"' in (ROOT / script).read_text()


def script_of(block: Block) -> str:
    """The block as it runs: continuation lines joined, each command shortened."""
    lines = block.code.replace("\\\n", " ").splitlines()
    return "\n".join(shortened(line) for line in lines) + "\n"


ALL = [b for path in DOCS for b in blocks_of(path)]
RUNNABLE = [b for b in ALL if b.lang in RUN and b.not_run is None]


def test_every_block_says_what_it_is() -> None:
    """A block without a language could hide a command that nothing runs."""
    unknown = [b.name for b in ALL if b.lang not in RUN + SHOWN]
    assert not unknown, f"blocks must be ```python, ```bash, ```yaml or ```text: {unknown}"
    assert DOCS[1:], "docs/ holds no .md file"


def test_opting_out_is_rare_and_says_why() -> None:
    skipped = [b.name for b in ALL if b.not_run is not None]
    assert len(skipped) <= MAX_NOT_RUN, skipped
    assert all(b.lang in RUN for b in ALL if b.not_run is not None)


def test_the_readme_is_short_and_links_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    for doc in DOCS[1:]:
        assert f"(docs/{doc.name})" in readme, doc.name


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", [*DOCS, RESULTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(path: Path) -> None:
    """Every relative link names a file that exists, and a heading that exists in it."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{path.name}: no #{anchor} there"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_working_notes(path: Path) -> None:
    """Docs are for users: no issue numbers, no notes on how loaded the machine was."""
    text = path.read_text()
    for note in (r"\bissue \d+", r"loaded VM", r"our own tests", r"while \w+ tests ran"):
        assert not re.search(note, text, re.I), f"{path.name}: working note {note!r}"


def test_the_suite_runs_every_docstring_example(request: pytest.FixtureRequest) -> None:
    """``python -m pytest`` collects src/'s doctests from every folder that has them (no folder
    of src/ is named like one pytest's norecursedirs skips, e.g. build/ or dist/)."""
    config = request.config
    assert config.getoption("doctestmodules"), "--doctest-modules is not in the suite's addopts"
    assert "src" in config.getini("testpaths")
    skipped = config.getini("norecursedirs")
    with_examples = {p.parent for p in (ROOT / "src").rglob("*.py") if ">>>" in p.read_text()}
    for directory in with_examples:
        parts = directory.relative_to(ROOT).parts
        hidden = [d for d in parts for pattern in skipped if fnmatch.fnmatch(d, pattern)]
        assert not hidden, f"{directory}: its doctests are never collected ({hidden})"


def test_shortening_is_what_running_md_documents() -> None:
    running = (ROOT / "docs" / "running.md").read_text()
    assert "trainer.max_steps=2" in running and "--quick" in running
    assert shortened("python train.py optim=sgd  # sgd") == (
        "python train.py optim=sgd trainer.max_steps=2  # sgd"
    )
    assert shortened("python train.py trainer.max_steps=5") == "python train.py trainer.max_steps=5"
    assert shortened("python benchmarks/engine_cpu.py") == "python benchmarks/engine_cpu.py --quick"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A copy of what a user's commands read beside the installed package."""
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, tmp_path / name)
    (tmp_path / "outputs").mkdir()  # a checkout has it (outputs/.gitkeep)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_block_runs_as_printed(block: Block, workdir: Path) -> None:
    # Each block is a unit of its own on xdist (tests/conftest.py SPREAD): they spread.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(workdir)])}
    if block.lang == "python":
        (workdir / "block.py").write_text(block.code)
        command = [sys.executable, "block.py"]
    else:
        bin_dir = str(Path(sys.executable).parent)  # "python" and "torchrun" of this venv
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        command = ["bash", "-euo", "pipefail", "-c", script_of(block)]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, f"{block.name} failed:\n{script_of(block)}\n{done.stderr[-3000:]}"
    # What a block writes goes under outputs/ (or a temporary folder), never beside a user's
    # checkout's own files (a generated photos/ or corpus/ in the repository's root); a user's
    # own package of models, or module of callbacks, must sit beside train.py to be imported.
    own = {"block.py", "mymodels", "my_callbacks.py", "scoring"}
    written = {p.name for p in workdir.iterdir()} - {*COPIED, "outputs", *own}
    assert not written, f"{block.name} wrote {sorted(written)} outside outputs/"
