"""The cost model: measures a pipeline, simulates schedules, predicts steps, plans and sizes.

Its modules, by the question each answers: what a layer costs (:mod:`.costs`,
:mod:`.materialize`, :mod:`.links`); how many layers a stage gets (:mod:`.balance`); how long a
step takes (:mod:`.simulate`, :mod:`.stage_profile`, :mod:`.predict`, :mod:`.measured`,
:mod:`.timeline`); which shape to run (:mod:`.planner`, :mod:`.replica_state`,
:mod:`.sharding_choice`, :mod:`.batch_fit`); how much memory (:mod:`.memory`,
:mod:`.stage_memory`, :mod:`.fit`, :mod:`.sizing`). A line each: docs/architecture.md#module-map;
how they work: docs/performance.md#how-the-cost-model-works; its words (plan, recompute, spec,
meter, tracker): docs/architecture.md#glossary.

The runner (``pipeline.plan=auto``, ``trainer.predict``), recipes and benchmarks import it; it
imports the engine, which never imports it (a forecast is ``predict(pipe, x, y, loss_fn)``, the
pipe read through a protocol). Nothing here knows a model by name (``recipes/model_sizes.py``).
"""

from giantpipe.perf.balance import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    solve_balance,
)

__all__ = ["balance_by_params", "balance_by_size", "balance_by_time", "solve_balance"]
