"""The memory estimates hold the optimizer's state a real training step holds (issue 40).

Each estimate is checked against the engine's measured step (``measure_stage``: the stage's
actions and a real optimizer step under the live-bytes tracker, on fake tensors): the per-layer
estimate (``profile_layer_memory``) against one stage's weights, gradients and optimizer state,
and the model-size search's predicted stage peaks (``size_model``) against the optimizer state
each measured stage holds. The measured state is a little larger: optimizers also keep a step
count per parameter tensor (a few bytes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.perf.memory import StageLoss, TensorSpec
from giantpipe.perf.sizing import Setting, measure_size, size_model
from giantpipe.perf.stage_memory import measure_stage, profile_layer_memory
from tests.unit.perf.tiny_family import TinyFamily

MICRO = 8
INPUT = TensorSpec((MICRO, 4), torch.float32)
LOSS = StageLoss(F.cross_entropy, TensorSpec((MICRO,), torch.long))


def meta_mlp() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(
            nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 3)
        )  # fmt: skip


@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop", "adam"])  # 0, 1 and 2 slots
def test_the_layers_resident_bytes_are_what_a_measured_step_holds_besides_activations(
    optimizer: str,
) -> None:
    layers = profile_layer_memory(meta_mlp(), INPUT, LOSS, optimizer)
    step = measure_stage(meta_mlp(), INPUT, chunks=2, recompute="never", loss=LOSS,
                         optimizer=optimizer)  # fmt: skip
    estimate = sum(layer.resident for layer in layers)
    # weights and buffers + gradients + the optimizer's state, as the step held them
    assert estimate == pytest.approx(step.param_memory, rel=0.005)


def test_predicted_stage_peaks_grow_by_the_optimizer_state_each_measured_stage_holds() -> None:
    family = TinyFamily()
    setting = Setting.uncut("Pipeline-2", 2, chunks=4, recompute="always")
    plain = size_model(family, setting, 4, 32, "sgd")  # no state besides the gradients
    adam = size_model(family, setting, 4, 32, "adam")
    assert plain is not None and adam is not None and plain.balance == adam.balance
    measured = [stage.optimizer for stage in measure_size(family, adam, "adam")]
    assert all(state > 0 for state in measured)
    grown = [a - p for a, p in zip(adam.predicted, plain.predicted, strict=True)]
    assert grown == pytest.approx(measured, rel=0.005)
