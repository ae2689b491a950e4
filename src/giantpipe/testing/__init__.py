"""Testing helpers: what tests, benchmarks and recipes use to check a pipeline and start ranks.

- :mod:`.reference`: the plain reference step, the un-pipelined model taking a pipeline's step
  (``reference_step``, ``accumulate_micro_batches``, ``plain_forward``, ``step_seed``);
- :mod:`.world`: a world of ranks on this machine (``free_port``, ``rank_env``);
- :mod:`.gpu`: where the GPU checks run, CUDA devices or CPU stand-ins (``GpuOptions``).
- :mod:`.outputs`: where a script writes its report, ``outputs/`` or (``--update-results``)
  ``results/`` (``add_output_options``, ``output_path``);
- :mod:`.reads`: the bytes a process reads from disk, and files dropped from the page cache.

It sits beside the entry points, above the engine, perf and runner: the library itself never
imports it.

Example::

    from giantpipe.testing import reference_step, step_seed

    plain, loss = reference_step(model, x, y, chunks=4, seed=step_seed(3))
"""

from giantpipe.testing.reference import (
    accumulate_micro_batches,
    plain_forward,
    reference_step,
    step_seed,
)
from giantpipe.testing.world import free_port, rank_env

__all__ = [
    "accumulate_micro_batches",
    "free_port",
    "plain_forward",
    "rank_env",
    "reference_step",
    "step_seed",
]
