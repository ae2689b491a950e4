"""PipelineSpec (giantpipe.engine.spec): one frozen value for a pipeline's shape, checked once
with messages naming the config key; both pipes take it and expose it; ``checkpoint=`` is only
torchgpipe's alias at GPipe's door."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from giantpipe import GPipe
from giantpipe.config import PipelineConfig
from giantpipe.engine import spec as spec_module
from giantpipe.engine.spec import (
    DEFAULT_CHUNKS,
    DEFAULT_RECOMPUTE,
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT,
    PipelineSpec,
    SpecError,
)

SCHEDULES = "['1f1b', 'gpipe', 'interleaved', 'zb-h1', 'zb-v']"

# (arguments, the spec's fields as normalised)
VALID: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        dict(balance=(2, 2)),
        dict(balance=(2, 2), chunks=1, schedule="gpipe", virtual_stages=1,
             recompute="except_last", devices=None, timeout=300.0),
    ),
    (
        dict(balance=[1, 1, 1, 1], chunks=4.0, schedule="interleaved"),
        dict(balance=(1, 1, 1, 1), chunks=4, virtual_stages=2),
    ),
    (dict(balance=(1, 1, 1, 1), schedule="zb-v"), dict(virtual_stages=2)),
    (dict(balance=(1, 1), virtual_stages=None), dict(virtual_stages=1)),
    (dict(balance=(3, 1), devices=["cpu", "cuda:1"]), dict(devices=("cpu", "cuda:1"))),
    (dict(balance=(3, 1), timeout=60, recompute="never"), dict(timeout=60.0, recompute="never")),
    (dict(balance=(), schedule="1f1b"), dict(balance=(), virtual_stages=1)),
]  # fmt: skip

# (arguments, the exact message; its key is the text before ": ")
INVALID: list[tuple[dict[str, Any], str]] = [
    (
        dict(balance=None),
        "pipeline.balance: balance is required; compute one with giantpipe.perf.balance "
        "(balance_by_time, balance_by_size or balance_by_params)",
    ),
    (
        dict(balance=(2, 0)),
        "pipeline.balance: all balance numbers must be positive integer (balance: [2, 0])",
    ),
    (
        dict(balance=(2, 1.5)),
        "pipeline.balance: all balance numbers must be positive integer (balance: [2, 1.5])",
    ),
    (dict(balance="params"), "pipeline.balance: must be a list of layer counts, got 'params'"),
    (
        dict(balance=(2, 2), chunks=0),
        "pipeline.chunks: number of chunks must be positive integer (chunks: 0)",
    ),
    (
        dict(balance=(2, 2), chunks=2.5),
        "pipeline.chunks: number of chunks must be positive integer (chunks: 2.5)",
    ),
    (
        dict(balance=(2, 2), chunks=True),
        "pipeline.chunks: number of chunks must be positive integer (chunks: True)",
    ),
    (
        dict(balance=(2, 2), chunks=2**20 + 1),
        "pipeline.chunks: must be at most 1048576 micro-batches per mini-batch, got 1048577",
    ),
    (
        dict(balance=(2, 2), recompute="sometimes"),
        "pipeline.recompute: must be one of 'always', 'except_last' or 'never', got 'sometimes'",
    ),
    (
        dict(balance=(2, 2), virtual_stages=-1),
        "pipeline.virtual_stages: must be a positive integer, got -1",
    ),
    (
        dict(balance=(2, 2, 1), schedule="interleaved"),
        "pipeline.virtual_stages: with virtual_stages=2, balance must list K*V stages "
        "(a multiple of 2); got 3 entries",
    ),
    (
        dict(balance=(2, 2), schedule="zigzag"),
        f"pipeline.schedule: unknown schedule 'zigzag'; choose one of {SCHEDULES}",
    ),
    (
        dict(balance=(), schedule="zigzag"),
        f"pipeline.schedule: unknown schedule 'zigzag'; choose one of {SCHEDULES}",
    ),
    (
        dict(balance=(1, 1, 1, 1), chunks=3, schedule="interleaved"),
        "pipeline.schedule: interleaved 1F1B needs the number of micro-batches (chunks=3) to be "
        "a multiple of the number of workers (2): micro-batches go round the stages in groups "
        "of K",
    ),
    (
        dict(balance=(1, 1), schedule="interleaved", virtual_stages=1),
        "pipeline.schedule: interleaved needs virtual_stages >= 2 (got 1); with one stage per "
        "worker use '1f1b'",
    ),
    (dict(balance=(2, 2), timeout=0), "pipeline.timeout: must be > 0 seconds, got 0"),
    (dict(balance=(2, 2), timeout=math.nan), "pipeline.timeout: must be > 0 seconds, got nan"),
    (
        dict(balance=(2, 2), timeout=1e10),
        "pipeline.timeout: must be at most 604800 s (a week), how long a stage may wait for "
        "another before the step fails; got 10000000000.0",
    ),
    (dict(balance=(2, 2), threads_per_worker=0), "threads_per_worker: must be >= 1, got 0"),
]


@pytest.mark.parametrize(("kwargs", "fields"), VALID)
def test_valid_specs_are_normalised(kwargs: dict[str, Any], fields: dict[str, Any]) -> None:
    spec = PipelineSpec(**kwargs)
    assert {name: getattr(spec, name) for name in fields} == fields
    assert spec == PipelineSpec(**kwargs) and hash(spec) == hash(PipelineSpec(**kwargs))


@pytest.mark.parametrize(("kwargs", "message"), INVALID)
def test_invalid_specs_name_the_config_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        PipelineSpec(**kwargs)
    assert str(info.value) == message
    assert info.value.key == message.split(": ")[0]
    assert isinstance(info.value, ValueError)  # what torchgpipe's users catch


def test_a_spec_is_frozen_and_replace_checks_anew() -> None:
    spec = PipelineSpec((1, 1, 1, 1), chunks=4, schedule="interleaved")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.chunks = 8  # type: ignore[misc]
    assert spec.replace(chunks=8).chunks == 8
    assert spec.replace(schedule="1f1b").virtual_stages == 1  # V inferred for the new one
    with pytest.raises(SpecError, match="^pipeline.chunks"):
        spec.replace(chunks=0)


def test_the_schedule_is_built_when_the_spec_is_made_and_only_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[str] = []
    real = spec_module.build_schedule

    def counting(name: str, *args: int) -> Any:
        built.append(name)
        return real(name, *args)

    monkeypatch.setattr(spec_module, "build_schedule", counting)
    spec = PipelineSpec((1, 1), chunks=4, schedule="1f1b", devices=("cpu", "cpu"))
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), spec=spec)
    pipe.train_step(torch.randn(4, 2), torch.randn(4, 2), nn.functional.mse_loss)
    pipe.train_step(torch.randn(4, 2), torch.randn(4, 2), nn.functional.mse_loss)
    assert built == ["1f1b"]
    assert pipe.spec is spec and pipe.step_schedule() is spec.step_schedule()
    with pytest.raises(ValueError, match="empty pipeline"):
        PipelineSpec(()).step_schedule()


# ---- the pipes' doors --------------------------------------------------------------------------


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())


def test_gpipe_takes_a_spec_or_its_keywords_and_exposes_the_same_spec() -> None:
    spec = PipelineSpec((3, 1), chunks=2, schedule="1f1b", recompute="never", timeout=30.0,
                        devices=("cpu", "cpu"), threads_per_worker=1)  # fmt: skip
    by_spec = GPipe(mlp(), spec=spec)
    by_keywords = GPipe(mlp(), [3, 1], devices=["cpu", "cpu"], chunks=2, schedule="1f1b",
                        recompute="never", timeout=30.0, threads_per_worker=1)  # fmt: skip
    assert by_spec.spec == by_keywords.spec == spec
    assert (by_spec.balance, by_spec.chunks, by_spec.recompute, by_spec.timeout) == (
        [3, 1], 2, "never", 30.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="give spec= or balance, not both"):
        GPipe(mlp(), [3, 1], spec=spec)
    with pytest.raises(ValueError, match="give spec= or chunks, not both"):
        GPipe(mlp(), spec=spec, chunks=4)


def test_checkpoint_is_torchgpipes_alias_of_recompute_at_gpipes_door_only() -> None:
    pipe = GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    assert pipe.recompute == pipe.spec.recompute == "always"
    assert pipe.checkpoint == "always"  # torchgpipe's attribute reads the same
    assert GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], recompute="never").checkpoint == "never"
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last'"):
        GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], checkpoint="sometimes")
    with pytest.raises(ValueError, match="recompute='never' and its alias checkpoint='always'"):
        GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], recompute="never", checkpoint="always")
    with pytest.raises(SpecError, match="^pipeline.recompute: must be one of"):
        GPipe(mlp(), [2, 2], devices=["cpu", "cpu"], recompute="sometimes")


def test_one_set_of_defaults_for_the_spec_both_pipes_and_the_config() -> None:
    from giantpipe.engine.distributed.pipe import DistributedPipe

    config = PipelineConfig()
    spec = PipelineSpec((2, 2))
    expected = (DEFAULT_CHUNKS, DEFAULT_RECOMPUTE, DEFAULT_SCHEDULE, DEFAULT_TIMEOUT)
    assert expected == (1, "except_last", "gpipe", 300.0)
    assert (config.chunks, config.recompute, config.schedule, config.timeout) == expected
    assert (spec.chunks, spec.recompute, spec.schedule, spec.timeout) == expected
    for pipe in (GPipe, DistributedPipe):
        params = {name: p.default for name, p in inspect.signature(pipe).parameters.items()}
        got = (params["chunks"], params["recompute"], params["schedule"], params["timeout"])
        assert got == expected
        assert "threads_per_stage" not in params
    assert "checkpoint" not in inspect.signature(DistributedPipe).parameters


# a parameter, keyword, field or attribute named checkpoint(s) (not a word in prose or ``code``)
MODE_NAMED_CHECKPOINT = re.compile(
    r"(?<![`\w])checkpoints?\s*[=:]|(?<!distributed)(?<!giantpipe)\.checkpoints?\b"
)


def test_checkpoint_names_the_mode_only_at_gpipes_door() -> None:
    src = Path(spec_module.__file__).parents[1]
    found = [
        f"{path.relative_to(src)}:{number}: {line.strip()}"
        for package in ("engine", "perf")
        for path in sorted((src / package).rglob("*.py"))
        # torchgpipe's alias: GPipe's door takes it, the one keyword constructor resolves it
        if path.relative_to(src).as_posix() not in ("engine/gpipe.py", "engine/spec.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if MODE_NAMED_CHECKPOINT.search(line)
    ]
    assert found == []
