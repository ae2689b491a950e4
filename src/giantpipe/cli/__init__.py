"""The command line (``train.py``): Hydra's side of giantpipe; the only part that touches Hydra.

- ``registration``: Hydra's ConfigStore (the experiment's and every option's schema) and the
  ``${run_id:}`` resolver of the run directories;
- ``schemas``: how an option file finds its schema (the lookup rule, plain imports);
- ``checks``: the config checks: renamed and unknown keys, the data fits the model, every
  schema's values (``to_experiment``), the late checks once torch is imported;
- ``errors``: one line per error, naming the config key or the path;
- ``job``: one job (``run_job``): exit codes, stop and failure bookkeeping, ``guarded``, torchrun
  ranks;
- ``usage``: ``--help``: the usage, the recipes' one-line summaries, the groups' options;
- ``sweep_table``: the Hydra callback that writes a multirun's sweep table (``SweepTable``).

Re-exported here: what ``train.py`` (``guarded``, ``run_job``) and saved runs' configs
(``giantpipe.cli.SweepTable``) name. Importing this package imports no torch.
"""

from giantpipe.cli.job import guarded, run_job
from giantpipe.cli.sweep_table import SweepTable

__all__ = ["SweepTable", "guarded", "run_job"]
