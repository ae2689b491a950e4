"""pipeline.plan=auto in-process on a tiny MLP: the planned knobs are the ones run, the choice is
in the summary, a budget nothing fits in is one line naming the key, and planning leaves the
model and the RNG streams as they were."""

from pathlib import Path

import pytest
import torch
from torch import nn

from giantpipe.config import (
    ConfigError,
    ExperimentConfig,
    LoggerConfig,
    OptimConfig,
    PipelineConfig,
    TrainerConfig,
)
from giantpipe.data.options import SyntheticDataConfig
from giantpipe.engine.spec import PipelineSpec
from giantpipe.runner import train
from giantpipe.runner.planning import as_run, chunk_options, optimizer_slots, plan_pipeline
from models.options import MlpModelConfig


def tiny(**pipeline) -> ExperimentConfig:
    return ExperimentConfig(
        name="tiny",
        model=MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4),
        data=SyntheticDataConfig(
            features=8, classes=4, train_size=256, eval_size=64, batch_size=12
        ),
        pipeline=PipelineConfig(**{"devices": "cpu", "num_devices": 2, "chunks": 2, **pipeline}),
        trainer=TrainerConfig(max_steps=3, eval_every=0, log_every=1, predict=False),
        logger=LoggerConfig(progress="none"),
    )


def test_plan_auto_runs_the_planned_balance_chunks_recompute_and_schedule(tmp_path: Path):
    # chunks=5 does not divide the batch of 12: the planner never picks it, so it shows whether
    # the run took the planned M
    cfg = tiny(plan="auto", memory_budget_gib=1.0, chunks=5, recompute="always")
    summary = train(cfg, tmp_path, "name: tiny\n")
    choice = summary["pipeline/plan_choice"]
    assert summary["status"] == "completed"
    assert choice["schedule"] in ("gpipe", "1f1b", "interleaved", "zb-h1")
    assert choice["recompute"] in ("always", "except_last", "never")
    assert 12 % choice["chunks"] == 0  # M divides the batch of 12
    assert summary["pipeline/chunks"] == choice["chunks"]
    assert summary["pipeline/balance"] == choice["balance"]
    assert len(choice["balance"]) == 2 * choice["virtual_stages"]
    assert choice["predicted_samples_per_s"] > 0 and 0 <= choice["predicted_bubble"] < 1
    assert choice["memory_budget_bytes"] == 2**30
    assert max(choice["predicted_peak_memory_bytes"]) <= 0.9 * 2**30
    assert choice["link_bandwidth_bytes_per_s"] is None  # two CPU stand-ins: nothing crosses
    assert choice["replicas"] == 1 and choice["replica_sharding"] is None  # the config's stands
    assert choice["replica_sharding_why"] == "one replica: nothing to shard"


def test_the_config_as_run_takes_the_planned_replica_sharding():
    spec = PipelineSpec((1, 3), chunks=3, schedule="1f1b")
    planned = tiny(plan="auto", replica_sharding="full")
    run = as_run(planned, spec, {"replica_sharding": "grads"}).pipeline
    assert (run.replica_sharding, run.balance, run.chunks, run.schedule) == (
        "grads", [1, 3], 3, "1f1b"
    )  # fmt: skip
    assert as_run(planned, spec, {"replica_sharding": None}).pipeline.replica_sharding == "full"
    fixed = tiny(replica_sharding="full")  # no plan: the config is the run's
    assert as_run(fixed, spec, {"replica_sharding": "grads"}) is fixed


def test_a_budget_nothing_fits_in_is_one_line_naming_the_key(tmp_path: Path):
    cfg = tiny(plan="auto", memory_budget_gib=1e-6)
    cfg.trainer.memory_check = (
        False  # the planner's own refusal (the pre-flight would refuse first)
    )
    with pytest.raises(ConfigError) as info:
        train(cfg, tmp_path / "run", "name: tiny\n")
    assert info.value.key == "pipeline.memory_budget_gib"
    assert "\n" not in str(info.value)
    assert "fits no plan for batch 12 on 2 devices; the leanest" in str(info.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_plan_and_budget_values_are_checked():
    with pytest.raises(ConfigError, match="pipeline.plan: must be null or auto, got 'yes'"):
        PipelineConfig(plan="yes")
    assert PipelineConfig(plan="auto", executor="distributed").plan == "auto"  # torchrun plans
    with pytest.raises(ConfigError, match="pipeline.memory_budget_gib: must be > 0"):
        PipelineConfig(memory_budget_gib=0)
    with pytest.raises(ConfigError, match="pipeline.virtual_stages: must be >= 1"):
        PipelineConfig(virtual_stages=0)


def test_search_space_follows_the_batch_and_the_optimizer():
    assert chunk_options(12) == [1, 2, 3, 4, 6, 12]
    assert chunk_options(12, min_micro=2) == [1, 2, 3, 4, 6]  # BatchNorm needs 2 per micro-batch
    assert [optimizer_slots(OptimConfig(name=n)) for n in ("adam", "adamw", "rmsprop")] == [2, 2, 1]
    assert optimizer_slots(OptimConfig(name="sgd")) == 0
    assert optimizer_slots(OptimConfig(name="sgd", momentum=0.9)) == 1
    assert optimizer_slots(OptimConfig(name="rmsprop", momentum=0.9)) == 2


def test_planning_leaves_parameters_statistics_and_rng_alone():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 4)
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    cfg = tiny(plan="auto", memory_budget_gib=1.0)  # its pipeline and optim; model given here
    rng = torch.get_rng_state()
    spec, choice = plan_pipeline(cfg, model, ["cpu", "cpu"], x, y, nn.functional.cross_entropy)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert 16 // choice["chunks"] >= 2  # BatchNorm: two samples per micro-batch at least
    assert (spec.chunks, spec.schedule) == (choice["chunks"], choice["schedule"])
    assert spec.devices == ("cpu", "cpu") and spec.timeout == cfg.pipeline.timeout  # as configured
