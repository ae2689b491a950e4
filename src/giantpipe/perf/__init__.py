"""The cost model: measures a pipeline, simulates schedules, predicts steps, plans and sizes.

What lives here, one module per concept:

- :mod:`.balance`: the one exact min-max balance solver (``solve_balance``, with an optional
  per-stage limit the planner uses) and the ``balance_by_*`` policies;
- :mod:`.costs`: the one per-layer cost record (``LayerCost``: FLOPs and bytes per sample,
  measured on the meta device) and measured seconds per layer (``LayerTimer``);
- :mod:`.materialize`: one layer of a model (built on meta, or real) made real on a device for
  a measurement, one at a time;
- :mod:`.links`: the link bandwidth the planner plans with, timed on the devices a process owns;
- :mod:`.simulate`: the simulator (any schedule against a cost per stage);
- :mod:`.stage_profile`: each stage measured alone, as the executor runs it;
- :mod:`.predict`: the forecast of a pipe's step, from the executor's replayed actions;
- :mod:`.planner`: the best balance, M, re-materialization and schedule, by simulation, and
  the one rule that merges layers' costs into a stage's (``merge_costs``);
- :mod:`.replica_state`, :mod:`.sharding_choice`: the bytes a rank holds under each replica
  sharding, and the sharding the planner picks (the least sharded that fits);
- :mod:`.batch_fit`: the fastest batch of M micro-batches that fits in memory (Table 2);
- :mod:`.fit`: whether a pipeline fits its devices' memory (the pre-flight check's verdict);
- :mod:`.memory`, :mod:`.stage_memory`, :mod:`.sizing`: memory sized without allocating it
  (the live-bytes tracker under fake tensors, one stage's training step, the largest model
  that fits: Table 1);
- :mod:`.timeline`: timelines, simulated or measured, as text or PNG.

Who imports it: the runner (``pipeline.plan=auto``, ``trainer.predict``), the recipes and the
benchmarks. It imports the engine; the engine never imports it: a forecast is
:func:`giantpipe.perf.predict.predict` given the pipe (this package reads a pipe through a
protocol and never imports ``GPipe``). Nothing here knows a model by name: the paper's models and
their sizes are in ``recipes/model_sizes.py``.

Words: a "plan" is only the planner's choice; re-materialization is "recompute" everywhere
(values 'always', 'except_last', 'never'); a pipe's shape is read from its ``spec``; the
saved-bytes *meter* is the engine's (what autograd keeps for backward), the memory *tracker*
counts every live byte.

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
