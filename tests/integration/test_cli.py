"""``python train.py`` answers at once: a config error exits 2 before torch is imported, ``--help``
names the recipes, and runs started together get their own directories."""

import subprocess
from pathlib import Path

import pytest

from giantpipe.cli.usage import NO_SUMMARY
from tests.support.train import HEAVY, REPO, error_lines, imported, start_train, train
from tests.timeouts import scaled

RECIPES = sorted(p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml"))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["trainer.foo=1"], "error: trainer.foo: unknown key"),
        (["trainer.max_steps=-1"], "error: trainer.max_steps: must be >= 1, got -1"),
        (["pipeline.chunks=0"], "error: pipeline.chunks: must be >= 1, got 0"),
        (["data.batch_size=abc"], "error: data.batch_size: Value 'abc' of type 'str'"),
        (["data.imagesize=64"], "error: data.imagesize: unknown key"),
        (
            ["data=tensors", "data.root=.", "data.features=784", "data.classes=10"],
            "error: data=tensors: model=amoebanet_d reads data.image_size, data.num_classes",
        ),
        # Bad values of the model's and the data's own schemas (their builders import torch,
        # torchvision or transformers; the schemas, in options modules, do not).
        (["model.num_layers=4"], "error: model.num_layers: must be a positive multiple of 3"),
        (["data.batch_size=0"], "error: data.batch_size: must be >= 1, got 0"),
        (["recipe=mlp_quickstart", "model.depth=0"], "error: model.depth: must be >= 1, got 0"),
        (["recipe=transformer_quickstart", "model.dropout=1.5"], "error: model.dropout: must be"),
        (["recipe=llama_quickstart", "model.layers=0"], "error: model.layers: must be >= 1"),
        (["recipe=torchvision_quickstart", "model.image_size=0"], "error: model.image_size: "),
        (["recipe=llama_text", "data.valid_fraction=2"], "error: data.valid_fraction: must be"),
        (["recipe=transformer_translation", "data.temperature=0"], "error: data.temperature: "),
    ],
)
def test_a_config_error_exits_2_before_torch_is_imported(args, expected, tmp_path: Path):
    result = train(*args, cwd=tmp_path, importtime=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert [line[: len(expected)] for line in error_lines(result)] == [expected]
    assert not imported(result) & set(HEAVY), "the config was checked after importing torch"
    assert not (tmp_path / "outputs").exists()


def test_the_readme_tensors_command_is_refused_naming_the_recipe_to_use(tmp_path: Path):
    result = train(
        "data=tensors", "data.root=.", "data.features=784", "data.classes=10", cwd=tmp_path
    )
    assert result.returncode == 2
    (line,) = error_lines(result)
    assert line.endswith("for this data use recipe=mlp_quickstart")


@pytest.mark.slow  # imports torch and torchvision (seconds to a minute on a busy machine)
def test_a_bad_value_that_needs_the_builders_module_exits_2_too(tmp_path: Path):
    """A rule that needs torchvision's list of models (the schema's check_installed()) runs once
    torch is imported: still one line, exit 2."""
    result = train("recipe=torchvision_quickstart", "model.name=resnet_nope", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = error_lines(result)
    assert line.startswith("error: model.name: not a torchvision classifier; one of ")


def test_help_lists_every_recipe_with_a_line_and_the_groups_a_user_chooses(tmp_path: Path):
    result = train("--help", cwd=tmp_path, importtime=True)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for recipe in RECIPES:
        (line,) = [row for row in lines if row.split()[:1] == [recipe]]
        assert len(line.split()) > 3 and NO_SUMMARY not in line, f"{recipe}.yaml: no # Summary:"
    groups = {row.split()[0] for row in lines if row.startswith("  ") and ", " in row}
    assert {"model", "data", "pipeline", "optim"} <= groups
    assert "recipe/" not in result.stdout and "ModelConfig" not in result.stdout
    assert "Exit status" in result.stdout
    assert not imported(result) & set(HEAVY)
    assert max(map(len, lines)) <= 100


def run_dir(tmp_path: Path) -> subprocess.Popen:
    return start_train("--cfg", "hydra", "--resolve", cwd=tmp_path, stderr=None)


def started_together(tmp_path: Path) -> tuple[str, str]:
    """The run directories two commands started at once would use (``--cfg hydra``: nothing
    trains), retried until both started within the same second."""
    for _ in range(5):
        pair = [run_dir(tmp_path), run_dir(tmp_path)]
        found = []
        for proc in pair:
            out, _ = proc.communicate(timeout=scaled(120))
            assert proc.returncode == 0
            rows = [row.strip() for row in out.splitlines()]
            (line,) = [r for r in rows if r.startswith("dir: outputs/") and "multirun" not in r]
            found.append(line.split(": ", 1)[1])
        if found[0].split("/")[-1][:8] == found[1].split("/")[-1][:8]:  # HH-MM-SS
            return found[0], found[1]
    pytest.fail("five pairs of commands never started within the same second")


def test_two_runs_started_in_the_same_second_get_different_directories(tmp_path: Path):
    first, second = started_together(tmp_path)
    assert first != second
