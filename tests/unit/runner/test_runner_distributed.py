"""The runner's torchrun pieces that need no processes: the config key, K and R, each rank's
device, the rank overrides, replica slices, checkpoint directories, and the one-line errors of
the dispatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from giantpipe.cli.checks import to_experiment
from giantpipe.cli.job import rank_overrides
from giantpipe.cli.registration import register_configs
from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    PipelineConfig,
    TrainerConfig,
)
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.runner import train
from giantpipe.runner.pipeline import pipeline_ranks, rank_device
from giantpipe.runner.rundir import resume_point
from giantpipe.runner.step import replica_slice
from models.options import MlpModelConfig
from tests.timeouts import scaled

CONF = Path(__file__).resolve().parents[3] / "conf"


def composed(*overrides: str) -> ExperimentConfig:
    register_configs(CONF)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_experiment(compose("config", overrides=["recipe=mlp_quickstart", *overrides]))


def tiny(**pipeline: object) -> ExperimentConfig:
    return ExperimentConfig(
        model=MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4),
        data=SyntheticDataConfig(features=8, classes=4, train_size=64, eval_size=16, batch_size=8),
        pipeline=PipelineConfig(**{"devices": "cpu", "num_devices": 2, "chunks": 2, **pipeline}),
        trainer=TrainerConfig(max_steps=1),
        logger=LoggerConfig(progress="none"),
    )


def test_executor_key_composes_with_local_as_default() -> None:
    assert composed().pipeline.executor == "local"
    cfg = composed("pipeline.executor=distributed", f"pipeline.timeout={scaled(20):g}")
    assert (cfg.pipeline.executor, cfg.pipeline.timeout) == ("distributed", 20.0)
    with pytest.raises(ConfigError, match=r"^pipeline.executor: must be one of local, distributed"):
        composed("pipeline.executor=mpi")


@pytest.mark.parametrize(
    ("pipeline", "world", "k"),
    [
        (PipelineConfig(devices="cpu", num_devices=2), 2, 2),
        (PipelineConfig(devices="cpu", num_devices=2), 4, 2),  # R = 2
        (PipelineConfig(balance=[3, 3, 2]), 3, 3),
        (PipelineConfig(), 4, 4),  # neither: every process is a stage
    ],
)
def test_pipeline_ranks_from_balance_num_devices_or_world(pipeline, world, k) -> None:
    assert pipeline_ranks(pipeline, world) == k


def test_pipeline_ranks_must_divide_the_world() -> None:
    with pytest.raises(ConfigError, match=r"^pipeline.num_devices: 2 pipeline ranks do not"):
        pipeline_ranks(PipelineConfig(num_devices=2), 3)
    with pytest.raises(ConfigError, match=r"^pipeline.balance: "):
        pipeline_ranks(PipelineConfig(balance=[2, 2, 2]), 4)


def test_each_rank_takes_its_local_rank_of_a_device_list() -> None:
    listed = PipelineConfig(devices=["cpu", "cpu", "cpu"])
    assert [rank_device(listed, 0, local_rank=r) for r in range(3)] == ["cpu"] * 3
    assert rank_device(PipelineConfig(devices=["cuda:1", "cuda:0"]), 2, local_rank=0) == "cuda:1"
    assert rank_device(PipelineConfig(devices="cuda"), 2, local_rank=1) == "cuda:1"
    assert rank_device(PipelineConfig(devices="auto"), 0, local_rank=1) == "cpu"
    with pytest.raises(ConfigError, match=r"^pipeline.devices: local rank 2 has no device"):
        rank_device(PipelineConfig(devices=["cpu", "cpu"]), 0, local_rank=2)
    with pytest.raises(ConfigError, match=r"^pipeline.devices: local rank 1 needs cuda:1"):
        rank_device(PipelineConfig(devices="cuda"), 1, local_rank=1)


def test_ranks_other_than_zero_get_no_log_file_nor_run_dir() -> None:
    argv = ["train.py", "recipe=mlp_quickstart"]
    assert rank_overrides(argv, 0) == argv
    assert rank_overrides(argv, 1) == [
        *argv,
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
        "hydra.run.dir=.",
    ]
    given = [*argv, "hydra.run.dir=/tmp/run"]
    assert rank_overrides(given, 3)[-1] == "hydra/hydra_logging=none"  # rank 0's dir is kept


def test_replica_slices_cover_the_batch_in_order() -> None:
    batch = (torch.arange(10), torch.arange(10) * 2)
    parts = [replica_slice(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), batch[0])
    assert [len(p[1]) for p in parts] == [4, 3, 3]
    assert replica_slice(batch[0], 0, 1) is batch[0]


def test_resume_rules(tmp_path: Path) -> None:
    assert resume_point(False, tmp_path) is None
    with pytest.raises(ConfigError, match=r"^trainer.resume: no checkpoint at .*last"):
        resume_point(True, tmp_path)
    (tmp_path / "last.pt").write_bytes(b"")  # the earlier one-file format still counts
    assert resume_point(str(tmp_path / "last.pt"), tmp_path / "new") == tmp_path / "last.pt"
    with pytest.raises(ConfigError, match=r"already holds a run \(last.pt\)"):
        resume_point(False, tmp_path)
    (tmp_path / "last.pt").unlink()
    (tmp_path / "last").mkdir()
    (tmp_path / "last" / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"already holds a run \(last/manifest.json\)"):
        resume_point(False, tmp_path)
    assert resume_point(True, tmp_path) == tmp_path / "last"
    assert resume_point(str(tmp_path / "last" / "manifest.json"), tmp_path / "b") == (
        tmp_path / "last"
    )


def test_distributed_without_torchrun_says_how_to_launch(tmp_path, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"^pipeline.executor: distributed needs .* torchrun"):
        train(tiny(executor="distributed"), tmp_path, "")
    assert not any(tmp_path.iterdir())


def test_local_executor_refuses_a_torchrun_world(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^pipeline.executor: local runs in one process"):
        train(tiny(), tmp_path, "")
