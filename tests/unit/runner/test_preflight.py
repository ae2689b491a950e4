"""The pre-flight check in-process on a tiny MLP: it sizes a meta model, refuses a run over its
budget in one line naming the keys that would fit it (each one predicted to fit, checked here),
lets a run that fits through, skips when told, and leaves every random stream as it was."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch import nn

from giantpipe.config import ConfigError, ExperimentConfig, PipelineConfig, TrainerConfig
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.runner.build import build_bundle, build_experiment
from giantpipe.runner.dry_run import dry_run
from giantpipe.runner.model import build_model
from giantpipe.runner.pipeline import worker_devices
from giantpipe.runner.preflight import (
    GIB,
    check_fit,
    checked_devices,
    forecast_run,
    host_available,
    machine_memory,
)
from giantpipe.runner.world import World
from models.options import MlpModelConfig


def tiny(budget_gib: float | None = None, **pipeline) -> ExperimentConfig:
    # wide activations, few parameters: what re-materialization and M change is most of it
    return ExperimentConfig(
        name="tiny",
        model=MlpModelConfig(in_features=64, hidden=256, depth=4, classes=4),
        data=SyntheticDataConfig(
            features=64, classes=4, train_size=512, eval_size=64, batch_size=64
        ),
        pipeline=PipelineConfig(
            **{
                "devices": "cpu",
                "num_devices": 2,
                "chunks": 2,
                "balance": "params",
                "recompute": "never",
                "memory_budget_gib": budget_gib,
                **pipeline,
            }
        ),
        trainer=TrainerConfig(max_steps=2, eval_every=0, predict=False),
    )


def peaks(cfg: ExperimentConfig) -> list[int]:
    bundle = build_bundle(cfg, None)
    devices, _ = worker_devices(cfg.pipeline, World())
    fit = forecast_run(cfg, bundle, devices, World(), lambda: build_model(cfg, bundle).layers)
    assert fit is not None
    return list(fit.outcome.simulation.peak_memory_bytes)


def check(cfg: ExperimentConfig) -> None:
    bundle = build_bundle(cfg, None)
    devices, _ = worker_devices(cfg.pipeline, World())
    check_fit(cfg, bundle, devices, World(), lambda: build_model(cfg, bundle).layers)


def test_a_run_over_budget_is_refused_in_one_line_naming_keys_that_fit():
    never, always = max(peaks(tiny())), max(peaks(tiny(recompute="always")))
    assert always < never
    budget = (always + never) / 2 / GIB  # re-materialization fits it, nothing else is needed
    with pytest.raises(ConfigError) as info:
        check(tiny(budget))
    line = str(info.value)
    assert info.value.key == "pipeline.memory_budget_gib" and "\n" not in line
    assert "recipe tiny does not fit: 2 devices of pipeline.memory_budget_gib=" in line
    assert "pipeline.recompute=always" in line and "data.batch_size=32" in line
    # every key it names is predicted to fit: checked by running the check with it
    named = line.split("predicted to fit with ")[1].split(" or ")
    for key in named:
        name, value = key.split("=")
        group, field = name.split(".")
        cfg = tiny(budget)
        if group == "pipeline":
            cfg = replace(cfg, pipeline=replace(cfg.pipeline, **{field: _typed(value)}))
        else:
            cfg = replace(cfg, data=replace(cfg.data, **{field: int(value)}))
        check(cfg)  # no ConfigError


def _typed(value: str) -> object:
    return int(value) if value.isdigit() else value


def test_a_run_that_fits_passes_and_memory_check_false_skips():
    never = max(peaks(tiny()))
    check(tiny(never / GIB))  # exactly full fits
    over = tiny(never / 2 / GIB)
    with pytest.raises(ConfigError):
        check(over)
    check(replace(over, trainer=replace(over.trainer, memory_check=False)))


def test_nothing_fits_names_what_it_wants():
    with pytest.raises(ConfigError) as info:
        check(tiny(1e-9))
    line = str(info.value)
    assert "no single change of pipeline.num_devices, pipeline.chunks" in line
    assert "it wants 2 devices of at least" in line


def test_the_model_is_built_on_meta_and_the_random_streams_are_untouched():
    cfg, built = tiny(), []
    cfg.pipeline.build = "host"  # the builder alone would make it real: the check's meta does not
    bundle = build_bundle(cfg, None)

    def build() -> nn.Sequential:  # a builder that draws from python's and torch's streams
        random.random()
        torch.rand(8, device="cpu")
        built.append(build_model(cfg, bundle).layers)
        return built[-1]

    torch.manual_seed(3)
    random.seed(3)
    expected = torch.rand(4).tolist(), random.random()
    torch.manual_seed(3)
    random.seed(3)
    check_fit(cfg, bundle, ["cpu", "cpu"], World(), build)
    assert (torch.rand(4).tolist(), random.random()) == expected
    assert {p.device.type for p in built[0].parameters()} == {"meta"}


def test_stand_ins_share_the_host_a_budget_is_per_device():
    memory = machine_memory(PipelineConfig(devices="cpu"), ["cpu", "cpu"], World())
    assert memory.members == [(0, "host"), (1, "host")]
    assert 0 < memory.capacity["host"] <= host_available() * 1.5
    budget = machine_memory(PipelineConfig(memory_budget_gib=2.0), ["cpu", "cpu"], World())
    assert budget.members == [(0, "device 0"), (1, "device 1")]
    assert budget.capacity == {"device 0": 2 * GIB, "device 1": 2 * GIB}


def test_dry_run_under_torchrun_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="trainer.dry_run: runs in one process") as info:
        dry_run(tiny())
    assert "\n" not in str(info.value)


class Rank(World):
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


@pytest.mark.parametrize(
    ("devices", "rank", "local", "per_host", "expected"),
    [
        # local executor: every device of this process
        ("cpu", 0, None, None, [(0, "cpu"), (1, "cpu")]),
        # torchrun on CPUs, K=2 x R=2, two ranks per host: rank 2's host runs ranks 2 and 3
        ("cpu", 2, 0, 2, [(0, "cpu"), (1, "cpu")]),
        ("cpu", 3, 1, 4, [(0, "cpu"), (1, "cpu"), (0, "cpu"), (1, "cpu")]),
        # torchrun on GPUs: its own device only (rank 3 is worker 1 of replica 1, on cuda:3)
        (["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 3, 3, 4, [(1, "cuda:3")]),
    ],
)
def test_each_process_checks_the_devices_it_answers_for(
    devices, rank, local, per_host, expected, monkeypatch
):
    if local is not None:
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_host))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = PipelineConfig(devices=devices, num_devices=2)
    world = World() if local is None else Rank(rank, 4)
    assert checked_devices(cfg, ["cpu", "cpu"] if devices == "cpu" else devices[:2], world) == (
        expected
    )


def test_the_build_sizes_a_model_built_by_share_whose_buffers_are_real(tmp_path, caplog):
    # built on meta by share, a BatchNorm's running statistics stay real: the build's own
    # pre-flight must still size it (not skip it with a warning) and refuse it over budget
    cfg = tiny(budget_gib=1e-4)
    cfg.model = replace(cfg.model, norm="batch")
    with caplog.at_level("WARNING", logger="giantpipe.runner.preflight"):
        with pytest.raises(ConfigError, match="does not fit") as info:
            build_experiment(cfg, tmp_path)
    assert info.value.key == "pipeline.memory_budget_gib"
    assert "pre-flight skipped" not in caplog.text
