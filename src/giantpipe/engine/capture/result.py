"""The captured model: :class:`Sequentialized` (its pieces, flatten and unflatten) and the
model's own parameter names (:class:`OriginalNames`), for it and for a pipe built on it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from giantpipe.engine.capture.graph import _Graph

__all__ = ["OriginalNames", "Sequentialized"]


class Sequentialized(nn.Sequential):
    """The captured model: children are pieces (``torch.fx.GraphModule``), in order.

    ``seq(seq.flatten(*args, **kwargs))`` runs the pieces on the flat tuple of input tensors;
    ``seq.unflatten(...)`` gives the model's output form back (a ModelOutput, a dict, ...).
    ``state_dict`` uses the model's parameter names; so does a pipe built on it.
    ``spans[i]``: the names of the submodules whose code piece ``i`` runs (``"model.layers.2"``
    and its insides; ``""``, the model's own forward), so that whoever built the model can give
    the pieces more (a Hugging Face model: key/value caches, ``models.hf``).
    """

    spans: list[frozenset[str]]

    def __init__(
        self, pieces: list[fx.GraphModule], graph: _Graph, example: Any, implied: Iterable[str]
    ) -> None:
        super().__init__(*pieces)
        self.in_spec = graph.in_spec
        self.input_slots = graph.input_slots  # flat leaf positions that are tensor inputs
        self.constants = {i: v for i, v in enumerate(graph.leaves) if i not in graph.input_slots}
        self.out_spec = graph.out_spec
        self.kwarg_order = list(example[1])
        self.implied = {k: v for k, v in example[1].items() if k in implied}
        self.original_names = OriginalNames.of(self, graph.model)
        self.original_names.install(self)

    def flatten(self, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The input of the first piece (and of a pipe): the tensors of ``(args, kwargs)``.

        Example (``seq = sequentialize(model, input_ids=ids, attention_mask=mask)``)::

            seq.flatten(input_ids=ids, attention_mask=mask)     # (ids, mask)
        """
        kwargs = {**self.implied, **kwargs}
        missing = set(self.kwarg_order) - set(kwargs)
        extra = set(kwargs) - set(self.kwarg_order)
        if missing or extra:
            raise TypeError(
                f"inputs must be given as in the example: missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}"
            )
        ordered = {k: kwargs[k] for k in self.kwarg_order}
        leaves, spec = pytree.tree_flatten((args, ordered))
        if spec != self.in_spec:
            raise TypeError(f"inputs do not have the example's structure: {spec} != {self.in_spec}")
        for i, value in self.constants.items():
            if leaves[i] != value:
                raise TypeError(
                    f"input {i} is {leaves[i]!r} but the model was captured with {value!r}; "
                    "sequentialize again with that value"
                )
        tensors = tuple(leaves[i] for i in self.input_slots)
        return tensors[0] if len(tensors) == 1 else tensors

    def unflatten(self, outputs: Any) -> Any:
        """The model's output form (dataclass, dict, tuple, tensor) from the last piece's."""
        flat = [outputs] if not isinstance(outputs, tuple) else list(outputs)
        return pytree.tree_unflatten(flat, self.out_spec)


class OriginalNames:
    """Maps the Sequential's state-dict keys (``"3.transformer.h.2.attn.c_attn.weight"``) to
    the model's (``"transformer.h.2.attn.c_attn.weight"``); a tied parameter gets all its names.

    Installed on the Sequential and, by the engine, on a pipe built on it (its children have the
    same names), as a state-dict hook and a load pre-hook that rename keys under any prefix.

    Example::

        pipe.state_dict().keys() == plain_model.state_dict().keys()   # True
    """

    def __init__(self, names: Mapping[str, list[str]]) -> None:
        self.names = dict(names)  # internal key -> original keys (first: the canonical one)
        self.internal: dict[str, list[str]] = {}  # original key -> internal keys (tied: several)
        for key, origs in names.items():
            for orig in origs:
                self.internal.setdefault(orig, []).append(key)

    @classmethod
    def of(cls, seq: nn.Module, model: nn.Module) -> OriginalNames:
        """The names of ``seq``'s state, found by tensor identity in ``model``'s."""
        by_id: dict[int, list[str]] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            by_id.setdefault(id(tensor), []).append(name)
        held = seq.state_dict(keep_vars=True).items()
        return cls({key: by_id[id(t)] for key, t in held if id(t) in by_id})

    def install(self, owner: nn.Module) -> None:
        """Registers the renaming hooks on ``owner`` (a Sequentialized or a pipe)."""
        # partial: torch marks its hooks with an attribute, which a bound method cannot take
        owner.register_state_dict_post_hook(functools.partial(self._save_hook))
        owner.register_load_state_dict_pre_hook(functools.partial(self._load_hook))

    def _save_hook(self, module: nn.Module, state: Any, prefix: str, meta: Any) -> None:
        items = list(state.items())
        state.clear()
        for key, value in items:
            local = key[len(prefix) :] if key.startswith(prefix) else None
            for name in self.names.get(local, [local]) if local is not None else [key]:
                state[prefix + name if local is not None else key] = value

    def _load_hook(self, module: nn.Module, state: Any, prefix: str, *args: Any) -> None:
        for key in list(state):
            local = key[len(prefix) :] if key.startswith(prefix) else None
            if local in self.internal:
                value = state.pop(key)
                for internal in self.internal[local]:  # a tied parameter: each piece's copy
                    if _holds(module, internal):  # a distributed pipe holds its stages only
                        state.setdefault(prefix + internal, value)


def _holds(module: nn.Module, key: str) -> bool:
    path, _, name = key.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return False
    return name in owner._parameters or name in owner._buffers  # noqa: SLF001
