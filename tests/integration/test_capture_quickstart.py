"""The torchvision quick start trains a CNN whose capture once failed at the first step:
``python train.py recipe=torchvision_quickstart model.name=mobilenet_v3_small``, shortened to two
steps of 8 images (its pieces open with in-place ops; it is cut at its 13 feature blocks). The
runner's path is the same for every CNN, so one runs here; every CNN's capture, its pieces
profiled on their own inputs (as ``pipeline.balance=time`` does) and a K=2 step are
tests/unit/engine/test_capture_cnns.py's (DenseNet-121's and EfficientNet-B0's among them). A
causal LM type transformers does not know is refused by name, in one line, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.train import ok, one_error_line, train

pytest.importorskip("torchvision")

SHORT = [
    "recipe=torchvision_quickstart",
    "data.train_size=32",
    "data.eval_size=16",
    "data.batch_size=8",
    "trainer.max_steps=2",
    "trainer.eval_every=2",
    "trainer.log_every=1",
    "trainer.predict=false",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mobilenet_v3_small"])
def test_the_torchvision_quick_start_trains(name: str, tmp_path: Path) -> None:
    run = tmp_path / name
    ok(train(*SHORT, f"model.name={name}", f"hydra.run.dir={run}", cwd=tmp_path, timeout=600))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss"] > 0 for r in steps)


def test_an_unknown_causal_lm_type_is_refused_by_name(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result = train("recipe=llama_quickstart", "model.architecture=gpt_nope", cwd=tmp_path)
    line = one_error_line(result)  # exit 2, as every other config error
    assert result.returncode == 2
    assert line.startswith("error: model.architecture: 'gpt_nope' is not a model type"), line
