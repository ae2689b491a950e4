"""Planning without the whole model: a model built on meta is measured one layer at a time, each
layer made real on the device, filled by the model's LayerInit, and dropped before the next.
What is measured equals what the same model with real parameters gives (bytes exactly, the timed
work itself: same inputs, same weights), and no more than one layer (a window, for the CPU's
round-robin timing) is ever held."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import giantpipe.perf.balance as balance_module
import giantpipe.perf.costs as costs_module
from giantpipe.engine.meta import build_on_meta, init_layers, seeded_init
from giantpipe.perf.balance import balance_by_size, balance_by_time, profile_sizes, time_layers
from giantpipe.perf.costs import LayerTimer, measure_layers, meta_copy, meta_sample
from giantpipe.perf.materialize import has_meta_parameters, layer_on

SEED = 3
CPU = torch.device("cpu")


def build() -> nn.Sequential:
    f64 = {"dtype": torch.float64}  # not the default: a copy must keep the model's dtype
    return nn.Sequential(
        nn.Linear(8, 32, **f64),
        nn.BatchNorm1d(32, **f64),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(32, 4, **f64),
    )


def real_and_meta() -> tuple[nn.Sequential, nn.Sequential]:
    real = build()
    init_layers(real, SEED)  # what the meta model's init gives each layer
    return real, build_on_meta(build)


def test_layer_on_makes_one_layer_real_and_leaves_the_model_on_meta() -> None:
    real, meta = real_and_meta()
    layer = layer_on(meta, 4, CPU, seeded_init(SEED))
    assert torch.equal(layer.weight, real[4].weight) and torch.equal(layer.bias, real[4].bias)
    assert has_meta_parameters(meta) and meta[4].weight.device.type == "meta"
    norm = layer_on(meta, 1, CPU, seeded_init(SEED))  # buffers real already: kept, then reset
    assert torch.equal(norm.running_var, real[1].running_var)
    copied = layer_on(real, 0, CPU)  # a real model needs no init: its layer is copied
    assert copied is not real[0] and torch.equal(copied.weight, real[0].weight)


def test_a_meta_layer_without_init_is_refused_by_name() -> None:
    meta = build_on_meta(build)
    with pytest.raises(ValueError, match=r"layer 4 \(Linear\) has its parameters on the meta"):
        layer_on(meta, 4, CPU)
    assert layer_on(meta, 2, CPU).__class__ is nn.ReLU  # no parameters: nothing to fill


def test_bytes_per_layer_are_the_same_from_a_meta_model() -> None:
    real, meta = real_and_meta()
    sample = meta_sample(torch.randn(4, 8, dtype=torch.float64), 2)
    assert measure_layers(meta_copy(meta), sample) == measure_layers(meta_copy(real), sample)
    x = torch.randn(6, 8, dtype=torch.float64)
    assert profile_sizes(meta, x, 4.0, CPU, seeded_init(SEED)) == profile_sizes(real, x, 4.0, CPU)


def timed_work(model: nn.Sequential, **init: Any) -> list:
    """What LayerTimer times: each call's layer weights and inputs (the original then runs)."""
    seen: list = []
    original = costs_module.profile_stages

    def spy(stages: list, devices: list, sample: Any, *args: Any, **kwargs: Any) -> Any:
        state = {k: v.clone() for k, v in stages[0].state_dict().items()}
        seen.append((kwargs["names"], state, sample.detach().clone()))
        return original(stages, devices, sample, *args, **kwargs)

    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    timer = LayerTimer(model, "cpu", x, y, nn.functional.cross_entropy, None, repeats=1, **init)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(costs_module, "profile_stages", spy)
        timer.calibrate([2, 8])
    assert sorted(timer.points) == [2, 8] and all(len(p) == 5 for p in timer.points.values())
    return seen


def test_the_timed_work_is_the_same_from_a_meta_model() -> None:
    real, meta = real_and_meta()
    torch.manual_seed(0)
    whole = timed_work(real)
    torch.manual_seed(0)
    by_layer = timed_work(meta, init=seeded_init(SEED))
    assert len(whole) == len(by_layer) == 10  # 5 layers at 2 sizes
    for (names, state, x), (names_meta, state_meta, x_meta) in zip(whole, by_layer):
        assert names == names_meta
        assert state.keys() == state_meta.keys()
        assert all(torch.equal(state[k], state_meta[k]) for k in state), names
        assert torch.equal(x, x_meta), names
    # each layer's input is the previous layer's output: the last Linear gets 32 features
    assert [tuple(x.shape) for _, _, x in by_layer[-2:]] == [(2, 32), (8, 32)]


@contextmanager
def held_layers(module: Any) -> Iterator[Callable[[], int]]:
    """Counts the layer copies ``module``'s ``layer_on`` makes that are alive at once."""
    alive, most = [0], [0]
    original = module.layer_on

    def counted(*args: Any, **kwargs: Any) -> nn.Module:
        layer = original(*args, **kwargs)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(layer, lambda: alive.__setitem__(0, alive[0] - 1))
        return layer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "layer_on", counted)
        yield lambda: most[0]


def deep_meta(layers: int = 12, width: int = 64) -> nn.Sequential:
    return build_on_meta(lambda: nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]))


def test_the_layer_timer_holds_one_layer_at_a_time() -> None:
    model, x = deep_meta(), torch.randn(4, 64)
    with held_layers(costs_module) as most:
        loss = nn.functional.mse_loss
        timer = LayerTimer(model, "cpu", x, x, loss, None, repeats=1, init=seeded_init(0))
        timer.calibrate([1, 4])
    assert most() == 1


def test_timing_and_sizing_for_a_balance_hold_one_window() -> None:
    model, x = deep_meta(), torch.randn(4, 64)
    layer_bytes = (64 * 64 + 64) * 4
    with held_layers(balance_module) as most:
        time_layers(model, x, CPU, repeats=1, init=seeded_init(0), window_bytes=3 * layer_bytes)
    assert most() == 3  # the round-robin goes round 3 layers at a time
    with held_layers(balance_module) as most:
        profile_sizes(model, x, 2.0, CPU, seeded_init(0))
    assert most() == 1
    # the policies take the meta model and its init as the runner gives them
    assert balance_by_size(3, model, x, init=seeded_init(0)) == [4, 4, 4]
    assert sum(balance_by_time(3, model, x, repeats=1, init=seeded_init(0))) == 12
