"""Train with a Hydra config: ``python train.py [recipe=NAME] [GROUP=OPTION] [KEY=VALUE ...]``.

    python train.py                               # the quick start (conf/config.yaml's recipe)
    python train.py pipeline.chunks=8 trainer.max_steps=50
    python train.py -m pipeline.chunks=1,4,8      # a sweep: one job per value

    python train.py --help                        # the recipes and the groups' options

Runs land in outputs/DATE/TIME.MICROSECONDS-PID (multiruns in outputs/multirun/.../N). The config
is checked before torch is imported: a usage or config error exits 2 at once, a failed run 1.
See docs/command-line.md, conf/ and src/giantpipe/cli/.
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from giantpipe.cli import guarded, run_job

CONF = Path(__file__).resolve().parent / "conf"


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """One job: returns the sweep objective (final eval loss by default; NaN if it failed)."""
    return run_job(cfg)


if __name__ == "__main__":
    guarded(main, CONF)
