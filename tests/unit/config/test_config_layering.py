"""House rule: the config is converted once at the entry point; nothing below imports OmegaConf.

The entry point is ``cli/``, the one package that knows Hydra (docs/architecture.md); every other
module of the package is below it, found here rather than listed, so a new one is held too."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "giantpipe"
ENTRY = SRC / "cli"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_nothing_below_the_entry_point_imports_omegaconf_or_hydra():
    files = [f for f in sorted(SRC.rglob("*.py")) if not f.is_relative_to(ENTRY)]
    assert {f.relative_to(SRC).parts[0] for f in files} >= {"engine", "runner", "data", "config"}
    forbidden = {"omegaconf", "hydra"}
    offenders = [str(f.relative_to(SRC)) for f in files if imported_modules(f) & forbidden]
    assert offenders == []


def test_only_register_configs_touches_hydra_in_config_py():
    for path in sorted((SRC / "config").glob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert not any(m and m.startswith("hydra") for m in top_level)


def test_models_know_nothing_of_giantpipe_hydra_or_omegaconf():
    files = sorted((SRC.parents[1] / "models").glob("*.py"))
    assert len(files) > 3
    forbidden = {"giantpipe", "hydra", "omegaconf"}
    offenders = [f.name for f in files if imported_modules(f) & forbidden]
    assert offenders == []
