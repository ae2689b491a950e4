"""Build a model without its parameters, then give real ones to the layers a rank holds.

A rank of a distributed pipeline must never allocate the other stages' parameters (that is the
point of pipelining a giant model). :func:`build_on_meta` runs the model's builder with every
*parameter* created on the meta device (no memory), while *buffers* (BatchNorm statistics,
sinusoidal position tables, masks: small, and often computed in ``__init__``) stay real.
:func:`allocate_layers` then allocates the local layers' parameters on the rank's device.

Their values come from :func:`init_layers`: layer ``i`` is re-initialised by its modules'
``reset_parameters()`` under a seed derived from (``seed``, ``i``), so it gets the same weights
whichever rank builds it and however the model is cut. Give the plain model the same treatment
(``init_layers(build(), seed)``) and it equals the pipeline; models with a custom initialisation
pass their own ``init(index, layer)`` or load the weights from a checkpoint instead.

Example::

    >>> model = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    >>> model[0].weight.device.type
    'meta'
    >>> allocate_layers(model, [2], torch.device("cpu"), init=seeded_init(seed=0))
    >>> model[2].weight.device.type, model[0].weight.device.type
    ('cpu', 'meta')
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from giantpipe.engine.rng import mix

LayerInit = Callable[[int, nn.Module], None]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter registered on a module is moved to the meta device.

    Patches ``nn.Module.register_parameter`` (which ``module.weight = Parameter(...)`` goes
    through); ``torch.empty`` of the original does not touch memory, so nothing is paid.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta  # noqa: SLF001 - the point of the exercise

    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_on_meta(build: Callable[[], nn.Sequential]) -> nn.Sequential:
    """Runs ``build()`` with parameters on the meta device and buffers real."""
    with parameters_on_meta():
        return build()


def seeded_init(seed: int) -> LayerInit:
    """Layer ``i`` re-initialised by ``reset_parameters()`` under seed ``mix(seed, i)``.

    The global RNG state is saved and restored, so the caller's random stream is unchanged.
    """

    def init(index: int, layer: nn.Module) -> None:
        with torch.random.fork_rng(devices=_cuda_devices(layer)):
            torch.manual_seed(mix(seed, index))
            for module in layer.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()

    return init


def init_layers(model: nn.Sequential, seed: int, layers: Iterable[int] | None = None) -> None:
    """Re-initialises ``layers`` (default: all) of ``model`` as the distributed pipe does.

    Example::

        plain = build()
        init_layers(plain, seed=0)   # now equals DistributedPipe(build, ..., seed=0)
    """
    init = seeded_init(seed)
    wanted = set(range(len(model))) if layers is None else set(layers)
    for index, layer in enumerate(model):
        if index in wanted:
            with torch.no_grad():
                init(index, layer)


def allocate_layers(
    model: nn.Sequential, layers: Iterable[int], device: torch.device, init: LayerInit | None
) -> None:
    """Gives ``layers`` of ``model`` real parameters on ``device``; others stay as they are.

    Parameters already real are moved; meta ones are allocated and must be set by ``init``
    (or by a state dict loaded right after, when ``init`` is None). Meta buffers (a model built
    entirely under ``torch.device("meta")``) are allocated too, and only ``reset_parameters``
    / ``reset_running_stats`` or a state dict can fill them: a buffer computed in ``__init__``
    (a position table) needs :func:`build_on_meta`, which keeps buffers real.
    """
    made: dict[int, nn.Parameter] = {}  # a parameter shared by layers held here stays shared
    for index in layers:
        layer = model[index]
        fresh = any(p.device.type == "meta" for p in layer.parameters())
        for module in layer.modules():
            for name, param in list(module._parameters.items()):  # noqa: SLF001
                if param is None:
                    continue
                if id(param) not in made:
                    data = (
                        torch.empty_like(param, device=device)
                        if param.device.type == "meta"
                        else param.detach().to(device)
                    )
                    made[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]  # noqa: SLF001
        for module in layer.modules():
            for name, buf in list(module._buffers.items()):  # noqa: SLF001
                if buf is not None and buf.device.type == "meta":  # built under device("meta")
                    module._buffers[name] = torch.empty_like(buf, device=device)  # noqa: SLF001
                    fresh = True
        layer.to(device)  # real buffers (and anything left)
        if fresh and init is not None:
            with torch.no_grad():
                init(index, layer)


def _cuda_devices(layer: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in layer.parameters() if p.device.type == "cuda"})


class _Absent(nn.Module):
    """Stands for a stage held by another rank; running it is a bug, said plainly."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: Any) -> Any:
        raise RuntimeError(f"stage {self.stage} is not held by this rank")


def local_stages(
    model: nn.Sequential,
    balance: list[int],
    stages: list[int],
    device: torch.device,
    init: LayerInit | None,
) -> list[nn.Module]:
    """Allocates ``stages`` of ``model`` cut by ``balance`` (see :func:`allocate_layers`); one
    module per stage.

    A held stage is a Sequential keeping its layers' names (so parameter names are the plain
    model's); any other stage is an :class:`_Absent` placeholder.
    """
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    layers = [i for s in stages for i in range(bounds[s], bounds[s + 1])]
    allocate_layers(model, layers, device, init)
    named = list(model.named_children())
    return [
        nn.Sequential(OrderedDict(named[bounds[s] : bounds[s + 1]])) if s in stages else _Absent(s)
        for s in range(len(balance))
    ]
