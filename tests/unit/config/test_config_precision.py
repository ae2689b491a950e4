"""pipeline.precision: fp32, bf16 and fp16 (GPUs without bf16) are accepted; anything else is
refused naming the key and the choices."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from giantpipe.cli.checks import to_experiment
from giantpipe.cli.registration import register_configs
from giantpipe.config import ConfigError, PipelineConfig

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs(CONF)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_precision_is_accepted(precision: str) -> None:
    assert PipelineConfig(precision=precision).precision == precision


def test_fp16_from_the_command_line() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_experiment(compose("config", overrides=["pipeline.precision=fp16"]))
    assert cfg.pipeline.precision == "fp16"


@pytest.mark.parametrize("bad", ["fp8", "float16", "FP16"])
def test_another_precision_is_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.precision.*fp32, bf16, fp16"):
        PipelineConfig(precision=bad)
