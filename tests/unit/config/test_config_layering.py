"""House rule: the config is converted once at the entry point; nothing below imports OmegaConf."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "giantpipe"
BELOW_THE_ENTRY = [
    "runner",
    "metrics",
    "data/text",
    "data/bundle.py",
    "data/options.py",
    "data/batch_order.py",
    "data/synthetic.py",
    "data/tensor_files.py",
    "data/lm_tokens.py",
    "config",
]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_runner_metrics_and_data_never_import_omegaconf():
    files = [
        f
        for entry in BELOW_THE_ENTRY
        for f in ((SRC / entry).rglob("*.py") if (SRC / entry).is_dir() else [SRC / entry])
    ]
    assert len(files) > 10
    offenders = [str(f.relative_to(SRC)) for f in files if "omegaconf" in imported_modules(f)]
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
