"""``python train.py --help``: the usage, each recipe's one-line summary, each group's options.

Ours, not Hydra's: it composes nothing and reads conf/ only (no Hydra, no torch), so it answers in
a fraction of a second; each recipe file gives its line after ``# Summary:``.

Example::

    print(usage(Path("conf")))
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

USAGE = """\
usage: python train.py [recipe=NAME] [GROUP=OPTION ...] [KEY=VALUE ...]
       python train.py -m KEY=A,B ...          a sweep: one job per value
       python train.py --cfg job [...]         print the composed config (every key), run nothing

Recipes (recipe=NAME; the default is {default}):
{recipes}

Groups (GROUP=OPTION: a recipe picks one option of each; choose another on the command line):
{groups}

Checkpoints kept, early stopping, your hooks (docs/running.md#keeping-checkpoints):
  trainer.keep_last=K trainer.keep_best=K trainer.monitor=eval/loss trainer.monitor_mode=min
  trainer.early_stop_patience=P trainer.early_stop_min_delta=D
  'trainer.callbacks=[{{_target_: mypkg.MyCallback}}]'

Exit status: 0 done; 1 the run failed; 2 a usage or config error (nothing trained, nothing
written); 129, 130, 143 stopped by SIGHUP, Ctrl-C, SIGTERM (after saving).
Runs land in outputs/DATE/TIME.MICROSECONDS-PID; more in docs/command-line.md."""


def usage(conf_dir: Path) -> str:
    """``python train.py --help``: the recipes, one line each (the ``# Summary:`` line of each
    conf/recipe/NAME.yaml), and the options of each group a user chooses. Reads conf/ only.

    Example::

        print(usage(Path("conf")))
    """
    recipes = sorted(Path(conf_dir, "recipe").glob("*.yaml"))
    width = max((len(p.stem) for p in recipes), default=0) + 2
    lines = [f"  {p.stem:<{width}}{recipe_summary(p)}" for p in recipes]
    groups = sorted(p for p in Path(conf_dir).iterdir() if p.is_dir() and p.name != "recipe")
    options = [
        textwrap.fill(
            ", ".join(sorted(o.stem for o in g.glob("*.yaml"))),
            width=100,
            initial_indent=f"  {g.name:<10}",
            subsequent_indent=" " * 12,
        )
        for g in groups
    ]
    main = yaml.safe_load(Path(conf_dir, "config.yaml").read_text())
    picks = [e["recipe"] for e in main.get("defaults", []) if isinstance(e, dict) and "recipe" in e]
    return USAGE.format(
        default=picks[0] if picks else "none", recipes="\n".join(lines), groups="\n".join(options)
    )


def recipe_summary(path: Path) -> str:
    """The one line a recipe file gives after ``# Summary:`` (its description in ``--help``)."""
    for line in path.read_text().splitlines():
        if line.startswith("# Summary:"):
            return line.removeprefix("# Summary:").strip()
    return NO_SUMMARY


NO_SUMMARY = "(no '# Summary:' line in its yaml)"
"""What ``--help`` says of a recipe file without its one line (tests/integration/test_cli.py
fails on it)."""
