"""Small experiments the runner's tests share: a tiny config run in this process, the MLP quick
start shrunk to seconds as ``train.py`` overrides, and what a run left read back.

Example::

    giantpipe.runner.train(tiny(checkpoint_every=3), tmp_path, "name: tiny\\n")   # six steps
    assert whole(tmp_path / "last") == 6          # every committed file checked, read whole
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from giantpipe.checkpoint.manifest import committed_files, read_manifest, verify
from giantpipe.checkpoint.run import read_checkpoint
from giantpipe.config import ExperimentConfig, LoggerConfig, PipelineConfig, TrainerConfig
from giantpipe.data.options import LMTokensDataConfig, SyntheticDataConfig
from models.options import HfCausalLmModelConfig, MlpModelConfig


def tiny(**trainer: Any) -> ExperimentConfig:
    """An MLP of three layers on generated data, two CPU stages, six steps (``trainer`` keys
    override), no progress bar."""
    return ExperimentConfig(
        name="tiny",
        model=MlpModelConfig(in_features=8, hidden=16, depth=3, classes=4),
        data=SyntheticDataConfig(
            features=8, classes=4, train_size=256, eval_size=64, batch_size=16
        ),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2),
        trainer=TrainerConfig(**{"max_steps": 6, "eval_every": 3, "log_every": 2, **trainer}),
        logger=LoggerConfig(progress="none"),
    )


def llama_config(**pipeline: Any) -> ExperimentConfig:
    """A two-layer Hugging Face Llama (built from its config, nothing downloaded) on generated
    tokens, two CPU stages, two steps (``pipeline`` keys override)."""
    return ExperimentConfig(
        name="llama",
        model=HfCausalLmModelConfig(layers=2, width=32, heads=4, kv_heads=2, vocab_size=64),
        data=LMTokensDataConfig(vocab_size=64, seq_len=16, batch_size=8, batches_per_epoch=10),
        pipeline=PipelineConfig(devices="cpu", num_devices=2, chunks=2, **pipeline),
        trainer=TrainerConfig(max_steps=2, eval_every=2, log_every=1, checkpoint_every=2),
        logger=LoggerConfig(progress="none"),
    )


QUICK_MLP = [
    "recipe=mlp_quickstart",  # the default job is the AmoebaNet quick start; these runs use the MLP
    "data.train_size=512",
    "data.eval_size=64",
    "model.depth=3",
    "model.hidden=16",
    "trainer.log_every=1",
    "trainer.eval_every=0",
]
"""The MLP quick start shrunk to seconds, as ``train.py`` overrides (each test adds its steps)."""

TORCHRUN_MLP = [
    "recipe=mlp_quickstart",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.checkpoint_every=3",
    "model.dropout=0.1",  # masks come from the step seeds: a resume must restore the RNG
    "data.train_size=512",
    "data.eval_size=128",
    "logger.progress=none",
]
"""Six steps of the MLP quick start, saved at 3 and 6, for ``torchrun train.py``."""


def kept_steps(run: Path) -> list[int]:
    """The steps of the ``step_N/`` checkpoints a run keeps, in order."""
    return sorted(int(p.name[5:]) for p in run.glob("step_*"))


def whole(folder: Path) -> int:
    """The step of a checkpoint whose every committed file matches its manifest, read whole."""
    manifest = read_manifest(folder)
    verify(folder, manifest, committed_files(manifest))
    return read_checkpoint(folder)["step"]
