"""Memory of a pipeline stage, sized without allocating it: Table 1's "largest model".

- :mod:`.tracker`: a dispatch mode that counts live storage bytes, also under fake tensors;
- :mod:`.stage`: one stage's real training step (the engine's forward/backward actions with
  re-materialization, then the optimizer) measured by the tracker, or by the CUDA allocator;
- :mod:`.layers`: per-layer costs and the stage peaks they predict, a balance on them;
- :mod:`.search`: the largest AmoebaNet-D / Transformer-L that fits a budget per device.

Example::

    from giantpipe.memory_model import AmoebaNetD, Setting, confirm, search

    family, budget = AmoebaNetD(batch=128), 8 * 2**30
    plans = search(family, [Setting("Pipeline-8", 8, 128, "always")], budget,
                   widths=[384, 512], depths=range(18, 200, 6))
    confirm(family, plans, budget).plan.params
"""

from giantpipe.memory_model.layers import LayerCost, balance_memory, profile_layers, stage_peaks
from giantpipe.memory_model.search import (
    AmoebaNetD,
    Plan,
    Result,
    Setting,
    TransformerL,
    confirm,
    measure_plan,
    search,
)
from giantpipe.memory_model.stage import StageLoss, StageMemory, measure_stage
from giantpipe.memory_model.tracker import LiveBytes

__all__ = [
    "AmoebaNetD",
    "LayerCost",
    "LiveBytes",
    "Plan",
    "Result",
    "Setting",
    "StageLoss",
    "StageMemory",
    "TransformerL",
    "balance_memory",
    "confirm",
    "measure_plan",
    "measure_stage",
    "profile_layers",
    "search",
    "stage_peaks",
]
