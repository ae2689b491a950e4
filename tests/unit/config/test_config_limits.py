"""Issue 13, items 9-11: sizes refused before anything is allocated, unknown ``+KEY``s refused,
and one-line errors that keep the key, the file and the reason; issue 32, item 8: every unknown
key names the key it probably meant."""

import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from giantpipe.cli.checks import check_known_keys, to_experiment
from giantpipe.cli.errors import one_line
from giantpipe.cli.registration import register_configs
from giantpipe.config import ConfigError, ExperimentConfig, check_fits_memory, host_memory_bytes

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs(CONF)


def composed(*overrides: str, conf: Path = CONF) -> ExperimentConfig:
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
        experiment = to_experiment(cfg)
        check_known_keys(cfg, experiment)
        return experiment


def refusal(*overrides: str, conf: Path = CONF) -> str:
    with pytest.raises((ConfigError, HydraException, ValueError, yaml.YAMLError)) as caught:
        composed(*overrides, conf=conf)
    return one_line(caught.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["pipeline.chunks=1000000000"], "pipeline.chunks: must be at most 1048576 micro-batches"),
        (["trainer.seed=18446744073709551616"], "trainer.seed: must be an integer in [0, 2**64)"),
        (["trainer.seed=-1"], "trainer.seed: must be an integer in [0, 2**64)"),
        (["optim.lr=1e39"], "optim.lr: 1e+39 overflows float32"),
        (
            ["pipeline.executor=distributed", "pipeline.timeout=1e10"],
            "pipeline.timeout: must be at most",
        ),
        (
            ["recipe=mlp_quickstart", "data.train_size=1000000000000"],
            "data.train_size, data.eval_size, data.features: the generated data set would take",
        ),
        (
            ["data=images_generated", "data.train_size=100000000000"],
            "data.train_size, data.eval_size, data.image_size: the rendered images would take",
        ),
        (
            ["recipe=transformer_lm_scaling", "data.vocab_size=10000000000000"],
            "data.vocab_size, data.branching: the successor table would take",
        ),
    ],
)
def test_an_absurd_size_is_one_line_naming_the_key_before_anything_is_built(
    overrides: list[str], expected: str
) -> None:
    assert refusal(*overrides).startswith(expected)


def test_the_memory_check_names_the_machine_and_the_size() -> None:
    check_fits_memory(host_memory_bytes(), "data.x", "all of it")  # exactly the RAM: allowed
    with pytest.raises(ConfigError, match=r"^data.x: all of it would take .* of memory; this "):
        check_fits_memory(host_memory_bytes() + 1, "data.x", "all of it")


def test_an_unknown_plus_key_is_refused_with_the_key_it_meant() -> None:
    line = refusal("+trainer.checkpoint_evry=5")
    assert line.startswith("trainer.checkpoint_evry: unknown key (not a field of TrainerConfig)")
    assert line.endswith("did you mean trainer.checkpoint_every?")


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("pipeline.chunk=4", "pipeline.chunks"),
        ("trainer.max_stpes=5", "trainer.max_steps"),
        ("optim.lr_schedule.nme=cosine", "optim.lr_schedule.name"),
        ("model.num_layer=3", "model.num_layers"),  # an option's own schema
        ("data.batchsize=8", "data.batch_size"),
        ("pipelin.chunks=4", "pipeline"),  # a group: named where Hydra stops, at the group
    ],
)
def test_every_unknown_key_names_the_key_it_meant(override: str, meant: str) -> None:
    """Issue 32, item 8: only +KEY= additions named the near key; `pipeline.chunk=4` did not."""
    line = refusal(override)
    assert line.split(": unknown key (Key ")[0] in override.split("=")[0]
    assert line.endswith(f"; did you mean {meant}?"), line


def test_an_unknown_key_with_no_near_field_is_refused_without_a_guess() -> None:
    assert refusal("trainer.zzzz=1") == (
        "trainer.zzzz: unknown key (Key 'zzzz' not in 'TrainerConfig')"
    )


def test_a_composition_error_keeps_its_reason() -> None:
    line = refusal("recipe=amoebanet_quickstart", "model.no_such_key=3")
    assert line.startswith("model.no_such_key")
    assert "\n" not in line and len(line) > len("model.no_such_key: ")


def test_a_yaml_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    broken = conf / "optim" / "adamw.yaml"
    lines = broken.read_text().splitlines()
    lines.append("betas: [0.9, 0.999")  # an unclosed flow sequence
    broken.write_text("\n".join(lines) + "\n")
    line = refusal("optim=adamw", conf=conf)
    assert line.startswith(f"{broken}:{len(lines)}") or line.startswith(
        f"{broken}:{len(lines) + 1}"
    )
    assert "flow sequence" in line
