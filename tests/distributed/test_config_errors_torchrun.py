"""A config refused under torchrun is said once, not once per rank: a bad value (refused by the
checks), an unknown key (refused by Hydra's composition) and a model that cannot be built on
meta (refused by the build, naming pipeline.build), each one ``error:`` line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import finish
from tests.support.train import train_under_torchrun

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("trainer.max_steps=-1", "error: trainer.max_steps: must be >= 1, got -1"),
        ("trainer.max_stpes=3", "error: trainer.max_stpes: unknown key"),
        (  # refused while every rank builds it on meta, not by the checks
            "model._target_=tests.unit.runner.meta_models.item_in_init",
            "error: pipeline.build: the model cannot be built without its parameters",
        ),
    ],
)
def test_a_refused_config_is_one_line_from_the_whole_launch(
    tmp_path: Path, override: str, said: str
) -> None:
    proc = train_under_torchrun(tmp_path / "run", "recipe=mlp_quickstart", override)
    code, out = finish(proc, timeout=180)
    assert code != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith(said) or errors[0].startswith(
        said.replace("error: ", "error: rank 1: ")
    )
    assert not (tmp_path / "run" / "config.yaml").exists()
