"""Testing helpers: what tests, benchmarks and recipes use to check a pipeline and start ranks.

Its modules: :mod:`.reference` (the plain reference step), :mod:`.world` (a world of ranks on
this machine), :mod:`.gpu` (CUDA devices or CPU stand-ins), :mod:`.outputs` (where a script
writes its report), :mod:`.held` and :mod:`.reads` (what a process holds, and reads from disk).
It sits beside the entry points; the library itself never imports it.

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
