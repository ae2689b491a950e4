"""The plain reference step: the un-pipelined model taking the step a pipeline takes.

Micro-batch by micro-batch, losses weighted and dropout seeded as the engine does; every test,
benchmark and recipe takes its plain reference here: docs/engine-internals.md#the-plain-reference.

>>> from giantpipe.engine import GPipe
>>> model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
>>> x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
>>> plain, loss = reference_step(model, x, y, chunks=3, seed=step_seed(1))
>>> pipe = GPipe(copy.deepcopy(model), [2, 1], devices=["cpu", "cpu"], chunks=3)
>>> _ = torch.manual_seed(1)  # the step seed the pipeline draws is step_seed(1)
>>> abs(pipe.train_step(x, y, nn.functional.cross_entropy).item() - loss) < 1e-6
True
>>> torch.allclose(pipe.partitions[0][0].weight.grad, plain[0].weight.grad)
True
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from giantpipe.config import ExperimentConfig
from giantpipe.data.bundle import DataBundle
from giantpipe.engine.meta import allocate_layers
from giantpipe.engine.microbatch import batch_size, scatter, to_device
from giantpipe.engine.rng import draw_step_seed, install_rng_hooks, rng_context
from giantpipe.runner.build import build_bundle
from giantpipe.runner.model import build_model

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(outputs, targets)``: a micro-batch's loss (its mean, or with a normalizer its sum)."""

Normalizer = Callable[[Any], float]
"""``normalizer(targets)``: what a summed loss is divided by (e.g. the batch's tokens)."""

CPU = torch.device("cpu")


def step_seed(seed: int) -> int:
    """The dropout seed a pipeline step draws right after ``torch.manual_seed(seed)``.

    >>> step_seed(3) == step_seed(3)
    True
    """
    torch.manual_seed(seed)
    return draw_step_seed()


def plain_model(cfg: ExperimentConfig, bundle: DataBundle | None = None) -> nn.Sequential:
    """The whole model of ``cfg`` as its run starts it, real on the host: the plain reference
    of a pipe of any layout, executor or device (built from the config, with ``bundle`` or the
    config's data as the sample a captured model needs)."""
    model = build_model(cfg, bundle if bundle is not None else build_bundle(cfg, None))
    if model.init is not None:
        allocate_layers(model.layers, range(len(model.layers)), CPU, model.init)
    return model.layers


def reference_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    chunks: int,
    seed: int,
    loss_fn: LossFn = nn.functional.cross_entropy,
    normalizer: Normalizer | None = None,
) -> tuple[nn.Module, float]:
    """The un-pipelined ``model`` run micro-batch by micro-batch (as gradient accumulation
    would), dropout seeded from ``seed`` as the engine seeds it, on a copy. Returns the trained
    copy and the mini-batch loss (see the module's example)."""
    plain = copy.deepcopy(model)
    handles = install_rng_hooks(plain)
    losses = accumulate_micro_batches(plain, inputs, targets, chunks, seed, loss_fn, normalizer)
    for h in handles:
        h.remove()
    loss_sum = 0.0
    for loss in losses:
        loss_sum += loss.item()
    return plain, loss_sum


def accumulate_micro_batches(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    chunks: int,
    seed: int,
    loss_fn: LossFn = nn.functional.cross_entropy,
    normalizer: Normalizer | None = None,
    *,
    total: float | None = None,
    placement: Sequence[tuple[int, torch.device]] | None = None,
    fill_drain: bool = False,
    dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> list[torch.Tensor]:
    """One step of the plain ``model`` itself (its RNG hooks installed: ``install_rng_hooks``),
    gradients accumulated into its parameters; returns each micro-batch's weighted loss,
    detached. Deferred BatchNorm is left for the caller to commit.

    - ``total``: what the weights divide by, when the batch is one replica's shard of a larger
      one (the whole batch's size, or its normalizer's sum); default: this batch's;
    - ``placement``: runs of layers of a Sequential and the device each runs on, each run under
      its device's dropout seeds, as a stage on that device (default: the whole model, CPU
      seeds); the targets go to the last run's device;
    - ``fill_drain``: every forward first, then the backwards last-in first-out (GPipe's order
      of adding gradients up; float addition is not associative); default: micro-batch by
      micro-batch (1F1B and the others);
    - ``dtype``: autocast to it around each micro-batch's forward and loss;
    - ``scaler``: backward through ``scaler.scale(loss)``.
    """
    last = placement[-1][1] if placement else CPU
    if total is None:
        total = float(batch_size(targets) if normalizer is None else normalizer(targets))
    losses = []
    for m, (x, y) in enumerate(zip(scatter(inputs, chunks), scatter(targets, chunks))):
        weight = batch_size(y) / total if normalizer is None else 1.0 / total
        with _autocast(last, dtype):
            out = plain_forward(model, x, seed, m, placement)
            loss = loss_fn(out, to_device(y, last)) * weight
        if not fill_drain:
            _backward(loss, scaler)
        losses.append(loss)
    for loss in reversed(losses) if fill_drain else ():
        _backward(loss, scaler)
    return [loss.detach() for loss in losses]


def _parts(
    model: nn.Module, placement: Sequence[tuple[int, torch.device]] | None
) -> list[tuple[nn.Module, torch.device]]:
    if placement is None:
        return [(model, CPU)]
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"a placement cuts a Sequential into runs of layers, not a {type(model)}")
    parts: list[tuple[nn.Module, torch.device]] = []
    start = 0
    for count, device in placement:
        parts.append((model[start : start + count].to(device), device))
        start += count
    return parts


def plain_forward(
    model: nn.Module,
    inputs: Any,
    seed: int,
    microbatch: int,
    placement: Sequence[tuple[int, torch.device]] | None = None,
) -> Any:
    """The plain ``model``'s forward of micro-batch number ``microbatch``: each run of layers
    of ``placement`` on its device (moved there), under that device's dropout seeds."""
    x = inputs
    for part, device in _parts(model, placement):
        with rng_context(seed, microbatch, device):
            x = part(to_device(x, device))
    return x


def _autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    (loss if scaler is None else scaler.scale(loss)).backward()
