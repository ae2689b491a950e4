"""The cost model: measures a pipeline, simulates schedules, predicts steps, plans and sizes.

What lives here: the exact min-max balance solver and the ``balance_by_*`` policies
(:mod:`.balance`), the simulator (:mod:`.simulate`), stage profiles and the executor's own
replayed timings (:mod:`.stage_profile`, :mod:`.replay`), the forecast of a step
(:mod:`.predict`) and timelines (:mod:`.timeline`). It imports the engine; the engine never
imports it. The runner and the benchmarks use it.

Example::

    from giantpipe.perf import balance_by_time

    balance = balance_by_time(2, model, sample_microbatch)   # layers per stage, e.g. [5, 3]
"""

from giantpipe.perf.balance import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    solve_balance,
)

__all__ = ["balance_by_params", "balance_by_size", "balance_by_time", "solve_balance"]
