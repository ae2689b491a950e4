"""A captured piece filled by its model's own initialisation, one original submodule at a time.

A piece keeps each parameter under the model's own path (``model.layers.2.mlp.up_proj.weight``),
so the model's submodules whose parameters a piece holds are found by name. Each is lent the
piece's tensors for the call and initialised as the model itself would (Hugging Face's
``_init_weights``, else the submodule's ``reset_parameters()``), children before parents as
Hugging Face's ``initialize_weights`` goes; the model itself can stay on the meta device.

Example::

    seq = sequentialize(build_on_meta(build), ids)
    init = piece_init(model, hf_init_module)       # LayerInit of the pieces
    GPipe(seq, [2, 2], devices=["cpu"] * 2, init=seeded(init, seed=0))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

from giantpipe.engine.meta import LayerInit

ModuleInit = Callable[[nn.Module, nn.Module], None]
"""``init_module(model, module)``: ``module``'s own parameters set as ``model`` sets them."""


def reset_module(model: nn.Module, module: nn.Module) -> None:
    """The default :data:`ModuleInit`: ``module.reset_parameters()``, where it has one."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def piece_init(model: nn.Module, init_module: ModuleInit = reset_module) -> LayerInit:
    """What fills a piece of ``model`` captured by :func:`~giantpipe.engine.capture.sequentialize`:
    ``init_module(model, m)`` for every submodule ``m`` of ``model`` holding a parameter of the
    piece, children first, each lent the piece's tensors during the calls."""
    order = list(_post_order(model))

    def init(index: int, piece: nn.Module) -> None:
        held = dict(piece.named_parameters(remove_duplicate=False))
        with _lent(model, held) as touched:
            for module in order:
                if id(module) in touched:
                    init_module(model, module)

    return init


@contextmanager
def _lent(model: nn.Module, held: dict[str, nn.Parameter]) -> Iterator[set[int]]:
    """Within it, the submodules of ``model`` hold the piece's tensors (``held``, by the model's
    parameter names) in place of their own; yields the ids of those submodules and of every
    module above them."""
    lent: list[tuple[nn.Module, str, nn.Parameter | None]] = []
    touched: set[int] = set()
    for path, module in model.named_modules():
        for name, own in list(module._parameters.items()):  # noqa: SLF001
            key = f"{path}.{name}" if path else name
            if key in held:
                lent.append((module, name, own))
                module._parameters[name] = held[key]  # noqa: SLF001
                parts = path.split(".") if path else []
                touched.update(
                    id(model.get_submodule(".".join(parts[:n]))) for n in range(len(parts) + 1)
                )
    try:
        yield touched
    finally:
        for module, name, own in lent:
            module._parameters[name] = own  # noqa: SLF001


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Every submodule once, each after its children (the order of Hugging Face's init)."""
    seen: set[int] = set()

    def walk(m: nn.Module) -> Iterator[nn.Module]:
        for child in m.children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from walk(child)
        yield m

    seen.add(id(module))
    yield from walk(module)
