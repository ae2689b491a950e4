"""A model built without its parameters, its layers made real one at a time, each by its own init.

:func:`build_on_meta` runs a builder with parameters on the meta device and buffers real; a pipe
then makes real only the layers it holds (:func:`materialize`: each allocated on the host,
filled by a :data:`LayerInit`, moved to its device). :func:`seeded` draws layer ``i`` under a
seed of (run seed, ``i``) alone: the same weights whatever the layout (docs/engine.md, "Giant
from the first byte").

>>> model = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
>>> allocate_layers(model, [2], torch.device("cpu"), init=seeded_init(seed=0))
>>> model[2].weight.device.type, model[0].weight.device.type
('cpu', 'meta')
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from giantpipe.engine.partition import shared_parameters
from giantpipe.engine.rng import mix

LayerInit = Callable[[int, nn.Module], None]
"""``init(index, layer)``: fills layer ``index``'s parameters in place (under no_grad)."""

HOST = torch.device("cpu")
_M = TypeVar("_M")


class UnsetError(ValueError):
    """A layer's init left one of its parameters (or meta buffers) without a value."""


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


def build_on_meta(build: Callable[[], _M]) -> _M:
    """Runs ``build()`` with parameters on the meta device and buffers real."""
    with parameters_on_meta():
        return build()


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is on the meta device (it has no values yet).

    >>> on_meta(nn.Linear(2, 2)), on_meta(nn.Linear(2, 2, device="meta"))
    (False, True)
    """
    return any(p.device.type == "meta" for p in module.parameters())


def reset_parameters(index: int, layer: nn.Module) -> None:
    """The default init of a layer: ``reset_parameters()`` of each of its modules, as their
    constructors call it (``nn.Linear``, ``nn.Conv2d``, ``nn.LayerNorm``, BatchNorm's running
    statistics too)."""
    for module in layer.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def seeded(init: LayerInit, seed: int) -> LayerInit:
    """``init`` with layer ``i`` drawn under seed ``mix(seed, i)``; the caller's random stream
    is left as it was.

    >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> seeded(reset_parameters, 7)(3, a); seeded(reset_parameters, 7)(3, b)
    >>> torch.equal(a.weight, b.weight)
    True
    """

    def run(index: int, layer: nn.Module) -> None:
        with torch.random.fork_rng(devices=_cuda_devices(layer)):
            torch.manual_seed(mix(seed, index))
            init(index, layer)

    return run


def seeded_init(seed: int) -> LayerInit:
    """:func:`reset_parameters` of layer ``i`` under seed ``mix(seed, i)`` (:func:`seeded`)."""
    return seeded(reset_parameters, seed)


def pipe_init(init: LayerInit | str | None, seed: int) -> LayerInit | None:
    """What a pipe's ``init`` argument means: ``"seeded"`` is :func:`seeded_init` of ``seed``,
    a function is itself, None leaves the layers unset (a state dict is loaded right after).

    >>> pipe_init(None, 0) is None
    True
    """
    if init == "seeded":
        return seeded_init(seed)
    if isinstance(init, str):
        raise ValueError(f"init must be 'seeded', a function or None; got {init!r}")
    return init


def init_layers(
    model: nn.Sequential,
    seed: int,
    layers: Iterable[int] | None = None,
    init: LayerInit | None = None,
) -> None:
    """Re-initialises ``layers`` (default: all) of a real ``model`` as a pipe built on meta
    initialises them (``init``: the model's own, default :func:`reset_parameters`, seeded by
    ``seed``); a parameter shared with an earlier layer keeps that layer's value.

    Example::

        plain = build()
        init_layers(plain, seed=0)   # now equals DistributedPipe(build, ..., seed=0)
    """
    fill = seeded(init or reset_parameters, seed)
    wanted = set(range(len(model))) if layers is None else set(layers)
    filled: set[int] = set()
    for index, layer in enumerate(model):
        if index in wanted:
            _fill(fill, index, layer, filled)


def allocate_layers(
    model: nn.Sequential, layers: Iterable[int], device: torch.device, init: LayerInit | None
) -> None:
    """:func:`materialize` of ``layers``, all on ``device``."""
    materialize(model, dict.fromkeys(layers, torch.device(device)), init)


def materialize(
    model: nn.Sequential,
    places: Mapping[int, torch.device],
    init: LayerInit | None,
    tied: Collection[tuple[int, str]] = (),
) -> None:
    """Gives the layers ``places`` names real parameters, each layer on its device; the
    others stay as they are. One layer at a time, in order: its meta parameters (and meta
    buffers, of a model built wholly under ``torch.device("meta")``) are allocated on the host,
    set by ``init(index, layer)`` and moved to the layer's device; real ones are moved.

    A parameter shared by several layers is made once, by the first (its device, its value):
    a later layer's init sees a scratch tensor in its place; where the first is not made here
    (another rank holds it), its value comes from there, so this layer's init need not set it
    (``tied`` adds such (layer, name) pairs that ``model`` cannot show: a one-layer copy). With
    ``init`` None the values are left unset, allocated on the device (a state dict is loaded
    right after). Any other parameter the init leaves unset is an :class:`UnsetError`.
    """
    later = {place for group in shared_parameters(model) for place in group[1:]} | set(tied)
    made: dict[int, nn.Parameter] = {}  # id of a parameter as found -> the real one
    filled: set[int] = set()  # real parameters that hold their values
    for index in sorted(places):
        device, layer = torch.device(places[index]), model[index]
        staging = HOST if init is not None else device
        fresh: list[torch.Tensor] = []
        for module in layer.modules():
            for name, param in list(module._parameters.items()):  # noqa: SLF001
                if param is None:
                    continue
                if id(param) not in made:
                    made[id(param)] = _real(param, staging, device, fresh, filled)
                module._parameters[name] = made[id(param)]  # noqa: SLF001
            for name, buf in list(module._buffers.items()):  # noqa: SLF001
                if buf is not None and buf.device.type == "meta":
                    blank = _unset(torch.empty_like(buf, device=staging))
                    module._buffers[name] = blank  # noqa: SLF001
                    fresh.append(blank)
        if fresh and init is not None:
            _fill(init, index, layer, filled)
            _check_set(index, layer, fresh, {name for i, name in later if i == index})
        _move(layer, fresh, device)


def _real(
    param: nn.Parameter,
    staging: torch.device,
    device: torch.device,
    fresh: list[torch.Tensor],
    filled: set[int],
) -> nn.Parameter:
    """The real parameter for ``param``: allocated on ``staging`` if on meta (then ``fresh``),
    else moved to ``device`` (its values kept: ``filled``)."""
    if param.device.type == "meta":
        real = nn.Parameter(_unset(torch.empty_like(param, device=staging)), param.requires_grad)
        fresh.append(real)
        return real
    real = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
    filled.add(id(real))
    return real


def _unset(tensor: torch.Tensor) -> torch.Tensor:
    """NaN where a float tensor has no value yet, so that an init which misses it is seen."""
    return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor


def _fill(init: LayerInit, index: int, layer: nn.Module, filled: set[int]) -> None:
    """``init(index, layer)`` under no_grad, except that parameters already ``filled`` (shared
    with an earlier layer, or real from the start) keep their values: the init writes into
    scratch tensors put in their place for the call. Adds the layer's parameters to
    ``filled``."""
    kept: list[tuple[nn.Module, str, nn.Parameter]] = []
    scratch: dict[int, nn.Parameter] = {}
    for module in layer.modules():
        for name, param in module._parameters.items():  # noqa: SLF001
            if param is not None and id(param) in filled:
                kept.append((module, name, param))
                if id(param) not in scratch:
                    blank = torch.empty(param.shape, dtype=param.dtype, device=HOST)
                    scratch[id(param)] = nn.Parameter(blank, param.requires_grad)
    for module, name, param in kept:
        module._parameters[name] = scratch[id(param)]  # noqa: SLF001
    try:
        with torch.no_grad():
            init(index, layer)
    finally:
        for module, name, param in kept:
            module._parameters[name] = param  # noqa: SLF001
    filled.update(id(p) for p in layer.parameters())


def _check_set(index: int, layer: nn.Module, fresh: list[torch.Tensor], tied: set[str]) -> None:
    unset = {id(t) for t in fresh if t.is_floating_point() and bool(t.isnan().any())}
    unset -= {id(t) for n, t in _tensors(layer) if n in tied}  # an earlier layer's values
    names = [n for n, t in _tensors(layer) if id(t) in unset]
    if names:
        raise UnsetError(
            f"layer {index} ({type(layer).__name__}): its init leaves {', '.join(names[:3])} "
            "without a value (a parameter no reset_parameters() or model init reaches)"
        )


def _tensors(layer: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from layer.named_parameters(remove_duplicate=False)
    yield from layer.named_buffers(remove_duplicate=False)


def _move(layer: nn.Module, fresh: list[torch.Tensor], device: torch.device) -> None:
    """The tensors made for ``layer`` on the host, and its buffers, moved to ``device`` (in
    place: a parameter shared with a later layer stays one object)."""
    made = {id(t) for t in fresh}
    with torch.no_grad():
        for module in layer.modules():
            for param in module._parameters.values():  # noqa: SLF001
                if param is not None and id(param) in made and param.device != device:
                    param.data = param.data.to(device)
            for name, buf in list(module._buffers.items()):  # noqa: SLF001
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf.to(device)  # noqa: SLF001


def _cuda_devices(layer: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in layer.parameters() if p.device.type == "cuda"})
