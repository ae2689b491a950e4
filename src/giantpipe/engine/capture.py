"""Bring your own model: capture any ``nn.Module`` as the flat ``nn.Sequential`` the engine cuts.

:func:`sequentialize` captures ``model``'s forward on example inputs with ``torch.export``
(non-strict: real Python runs, shapes stay symbolic, so batch and sequence sizes may change),
then cuts the graph into pieces at named submodules. Each piece is one child of the returned
Sequential; whatever crosses a cut (hidden states, attention masks, position ids, residual
branches, integer and bool tensors, sizes) travels as the tuple between children::

    model.forward                      Sequentialized
      embed -> h.0 -> h.1 -> head        [0: embed] -> [1: h.0] -> [2: h.1] -> [3: head]
      (input_ids, mask)                  (input_ids, mask) -> (hidden, mask, ...) -> logits

Exactness: a piece runs the captured aten ops in the original order, on the original parameter
objects, so outputs and every gradient equal the model's. What a graph cannot hold is kept as a
layer: BatchNorm and dropout-like modules stay modules (``.eval()`` switches them; the engine
seeds them, so re-materialization replays their masks), and any other random op (functional
dropout, attention dropout) becomes a :class:`RandomOp` layer.

Names: ``state_dict()`` of the Sequential, and of a pipe built on it, uses the model's own
parameter names (:class:`OriginalNames`), so checkpoints load into the plain model with
``strict=True`` and back. A parameter used on both sides of a cut (tied input and output
embeddings) is, by default, held by every piece that uses it (``tied="share"``): one object,
which the engine keeps tied across stages (a copy per device whose gradients it sums once a
step). ``tied="carry"`` instead holds it in its first piece and carries it along the pipeline
as a value (one tensor, but it crosses every cut each micro-batch, forward and backward);
``tied="error"`` refuses such a cut.

Example::

    seq = sequentialize(gpt2, input_ids=ids, split_points=["transformer.h.4", "transformer.h.8"])
    pipe = GPipe(seq, balance=[1, 1, 1], devices=["cpu"] * 3, chunks=4)
    out = seq.unflatten(pipe(seq.flatten(input_ids=ids)))     # CausalLMOutput, as gpt2's
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from giantpipe.engine.rng import uses_rng

__all__ = ["CaptureError", "OriginalNames", "RandomOp", "Sequentialized", "sequentialize"]

aten = torch.ops.aten
_DROPOUTS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default}
_DROPOUTS |= {aten.feature_alpha_dropout.default}
_SDPA = aten.scaled_dot_product_attention.default


class CaptureError(ValueError):
    """A model that :func:`sequentialize` cannot capture or cut; the message names the
    submodule and what to do instead. ``about`` says which argument to change: ``"model"``
    (its forward), ``"split_points"``, ``"output"``, ``"tied"`` or ``"example"`` (the inputs)."""

    def __init__(self, message: str, about: str = "model") -> None:
        super().__init__(message)
        self.about = about


def sequentialize(
    model: nn.Module,
    *example_args: Any,
    split_points: Sequence[str] | None = None,
    output: str | int | None = None,
    tied: str = "share",
    **example_kwargs: Any,
) -> Sequentialized:
    """``model`` as a flat Sequential whose forward equals ``model(*args, **kwargs)``.

    Args:
        model: any module whose forward torch.export can capture (no Python branches on
            tensor values).
        example_args, example_kwargs: a sample batch, batch size at least 2; every tensor's
            first dimension is the batch (micro-batches cut it).
        split_points: submodule names where a new piece starts, e.g. ``["layer2", "layer3"]``;
            default: every repeated block (children of a ModuleList / Sequential of one class:
            transformer layers, residual blocks) and the head after the last one.
        output: keep only this field of a dataclass / dict output (``"logits"``) or this
            position of a tuple output, so that the pipeline ends with one tensor.
        tied: a parameter used on both sides of a cut: ``"share"`` it between the pieces that
            use it (the engine keeps the stages' copies equal), ``"carry"`` it along the
            pipeline as a value, or ``"error"`` to refuse such a cut.

    Example::

        seq = sequentialize(torchvision.models.resnet50(), torch.randn(2, 3, 224, 224))
        balance = balance_by_time(4, seq, x)                 # pieces: stem, 16 blocks, head
        y = seq(seq.flatten(x))                              # == resnet50(x)
    """
    if tied not in ("share", "carry", "error"):
        raise ValueError(f"tied must be 'share', 'carry' or 'error', got {tied!r}")
    for name in split_points or ():  # before the export: a wrong name fails at once
        _check_split_point(model, name)
    kwargs = _with_defaults(model, example_kwargs)
    program = _export(model, example_args, kwargs)
    graph = _Graph(program, model)
    graph.keep_layers()
    graph.out_of_place()
    graph.select_output(output)
    cuts = _cut_positions(graph, model, split_points)
    pieces, carried = _partition(graph, cuts, tied)
    seq = Sequentialized(pieces, graph, (example_args, kwargs), set(kwargs) - set(example_kwargs))
    seq.spans = _spans(graph.nodes(), cuts)
    seq.train(model.training)
    return seq


# ---- the result ---------------------------------------------------------------------------


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


class RandomOp(nn.Module):
    """An op of the captured graph that draws random numbers, as a layer: the engine seeds it
    before it runs (so re-materialization replays its mask), and ``.eval()`` turns dropout off
    (``train`` argument False, ``dropout_p`` 0), as the model's own code would have.

    Example::

        drop = RandomOp(torch.ops.aten.dropout.default)
        y = drop(x, 0.1, True)      # x itself after drop.eval()
    """

    giantpipe_uses_rng = True  # giantpipe.engine.rng seeds it (its class name says nothing)

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training and self.op in _DROPOUTS:
            args = (*args[:2], False, *args[3:])
        elif not self.training and self.op is _SDPA:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
        return self.op(*args, **kwargs)


# ---- capture ------------------------------------------------------------------------------


def _with_defaults(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face model would return its key/value cache, which no pipeline carries."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params and "use_cache" not in kwargs:
        return {**kwargs, "use_cache": False}
    return dict(kwargs)


def _dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every tensor dimension may vary (export keeps symbolic what the code allows)."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return None
        return {d: torch.export.Dim.AUTO for d in range(value.dim())}

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch.export in training mode (dropout present), every module's mode restored after."""
    sizes = {t.shape[0] for t in pytree.tree_leaves((args, kwargs)) if _batched(t)}
    if not sizes or min(sizes) < 2:
        raise CaptureError(
            "sequentialize: give an example batch of at least 2 samples (a batch of 1 would be "
            "captured as a constant size, and micro-batches could not vary)",
            "example",
        )
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        return torch.export.export(
            model, args, kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs), strict=False
        )
    except Exception as exc:  # noqa: BLE001 - any capture failure becomes one message
        raise CaptureError(_capture_failure(exc, model)) from exc
    finally:
        for module, mode in modes.items():
            module.training = mode


def _batched(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _capture_failure(exc: BaseException, model: nn.Module) -> str:
    """One message: the innermost submodule whose forward failed, why, and what to do."""
    names = {id(m): name for name, m in model.named_modules()}
    where, seen = None, set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        tb = cause.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in names:
                where = names[id(owner)] or type(model).__name__
            tb = tb.tb_next
        cause = cause.__cause__ or cause.__context__
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    module = f"`{where}`" if where else f"`{type(model).__name__}`"
    data = "data-dependent" in str(exc) or "GuardOnDataDependent" in type(exc).__name__
    hint = (
        "its forward branches on tensor values (Python control flow on data), which no graph "
        "can hold: compute it with tensor ops (torch.where, torch.cond) or decide it by a "
        "Python argument passed as an example keyword"
        if data
        else "make its forward traceable by torch.export (non-strict), or pass the inputs "
        "that decide its branches as example keywords"
    )
    return f"sequentialize: cannot capture {module}: {type(exc).__name__}: {reason}; {hint}"


class _Graph:
    """The exported graph, prepared for cutting: parameters resolved to the model's objects,
    assertions dropped, BatchNorm / dropout modules and random ops turned into layers."""

    def __init__(self, program: Any, model: nn.Module) -> None:
        self.model = model
        self.graph: fx.Graph = program.graph
        self.owner = program.graph_module  # holds the graph's get_attr targets (HOP bodies)
        signature = program.module_call_graph[0].signature
        self.in_spec, self.out_spec = signature.in_spec, signature.out_spec
        self.leaves = pytree.tree_leaves(program.example_inputs or ((), {}))
        self.attrs: dict[fx.Node, tuple[str, Any]] = {}  # placeholder -> (fqn, object)
        self.constants: dict[fx.Node, torch.Tensor] = {}
        self.inputs: list[fx.Node] = []
        self.input_slots: list[int] = []
        self._resolve_placeholders(program)
        self.layers: dict[str, nn.Module] = {}  # new RandomOp layers by name
        self._drop_assertions()

    def _resolve_placeholders(self, program: Any) -> None:
        first: dict[int, fx.Node] = {}  # a tied parameter: one placeholder for all its names
        nodes = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        slot = 0
        for spec in program.graph_signature.input_specs:
            node = nodes[spec.arg.name]
            kind = spec.kind.name
            if kind == "USER_INPUT":
                if node.users or isinstance(node.meta.get("val"), torch.Tensor):
                    self.inputs.append(node)
                    self.input_slots.append(slot)
                slot += 1
            elif kind in ("PARAMETER", "BUFFER"):
                obj = _lookup(self.model, spec.target)
                if id(obj) in first:
                    node.replace_all_uses_with(first[id(obj)])
                    continue
                first[id(obj)] = node
                self.attrs[node] = (spec.target, obj)
            else:  # lifted tensor constants: copied into every piece that uses them
                self.constants[node] = program.constants[spec.target]

    def _drop_assertions(self) -> None:
        # Shape checks of the traced sizes (e.g. batch >= 2): the pieces run eagerly on
        # whatever micro-batch comes, as the model would.
        for node in list(self.graph.nodes):
            name = getattr(node.target, "__name__", str(node.target))
            if node.op == "call_function" and not node.users and "assert" in name:
                self.graph.erase_node(node)

    def keep_layers(self) -> None:
        """BatchNorm and dropout-like module calls become calls of the modules themselves;
        other random ops become :class:`RandomOp` layers."""
        groups: dict[str, list[fx.Node]] = {}
        for node in self.graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            if stack and node.op == "call_function":
                key, (path, _) = list(stack.items())[-1]
                if _kept(_module_at(self.model, path)):
                    groups.setdefault(key, []).append(node)
        for nodes in groups.values():
            path = list(nodes[0].meta["nn_module_stack"].values())[-1][0]
            self._collapse(path, nodes)
        for node in list(self.graph.nodes):
            if node.op == "call_function" and _random(node):
                name = f"random_op_{len(self.layers)}"
                self.layers[name] = RandomOp(node.target)
                node.op, node.target = "call_module", name

    def out_of_place(self) -> None:
        """In-place ops on values the graph computed become their out-of-place twins
        (``relu_`` -> ``relu``, ``hardswish_``, ``add_``) wherever nothing else can tell.

        A piece may start with such an op (``nn.ReLU(inplace=True)`` right after a cut), and
        then its input is a leaf that requires grad (a stage's first piece, each piece that
        ``balance_by_time`` profiles), which autograd refuses to change in place. Safe when the
        changed value is fresh (no view or alias of another) and read by nobody after the op:
        later readers already read the op's result, as export recorded them.
        """
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in self.graph.nodes:
            twin = _out_of_place_twin(node)
            if twin is not None and self._fresh(node.args[0], node, order):
                node.target = twin

    def _fresh(self, value: Any, node: fx.Node, order: Mapping[fx.Node, int]) -> bool:
        """``value`` is a new tensor (not an input, a parameter or a view of another: an op
        whose result aliases none of its arguments, or a BatchNorm layer) that no node after
        ``node`` reads."""
        if not isinstance(value, fx.Node):
            return False
        op = value.target
        if value.op == "call_module":
            new = _is_batchnorm(self.layers.get(str(op)))
        else:
            new = isinstance(op, torch._ops.OpOverload) and value.op == "call_function"  # noqa: SLF001
            new = new and not any(r.alias_info for r in op._schema.returns)  # type: ignore[union-attr]
        return new and all(order[u] < order[node] for u in value.users if u is not node)

    def _collapse(self, path: str, nodes: list[fx.Node]) -> None:
        inside = set(nodes)
        own = {n for n, (fqn, _) in self.attrs.items() if fqn.startswith(path + ".")}
        sources = {a for n in nodes for a in n.all_input_nodes} - inside - own
        results = [n for n in nodes if any(u not in inside for u in n.users)]
        module = _lookup(self.model, path)
        if len(sources) != 1 or len(results) != 1:
            if _is_batchnorm(module):
                raise CaptureError(
                    f"sequentialize: cannot keep BatchNorm `{path}` as a layer (it takes "
                    f"{len(sources)} inputs and gives {len(results)} outputs in the graph)"
                )
            return  # a dropout module with extra inputs: its ops become RandomOp layers
        result = results[0]
        with self.graph.inserting_before(result):
            call = self.graph.create_node("call_module", path, (sources.pop(),))
        call.meta = dict(result.meta)
        result.replace_all_uses_with(call)
        for node in reversed(nodes):
            self.graph.erase_node(node)
        self.layers[path] = module

    def select_output(self, output: str | int | None) -> None:
        """Keeps one field of the output (``"logits"``); the rest of the graph is dropped."""
        if output is None:
            return
        (out,) = [n for n in self.graph.nodes if n.op == "output"]
        flat = list(out.args[0])
        shape = pytree.tree_unflatten(list(range(len(flat))), self.out_spec)
        try:
            index = shape[output] if not hasattr(shape, "__dataclass_fields__") else None
            index = getattr(shape, str(output)) if index is None else index
        except (KeyError, IndexError, AttributeError, TypeError) as err:
            raise CaptureError(
                f"sequentialize: the model's output has no field {output!r} (it returns "
                f"{type(shape).__name__}); pick one of its fields or output=None",
                "output",
            ) from err
        if not isinstance(index, int):
            raise CaptureError(f"sequentialize: output {output!r} is not one tensor", "output")
        out.args = ((flat[index],),)
        self.out_spec = pytree.tree_flatten(0)[1]
        self._drop_dead_code()

    def _drop_dead_code(self) -> None:
        # fx's own pass would look the layers up on export's module, which has none of them.
        for node in reversed(self.graph.nodes):
            if node.users or node.op in ("placeholder", "output"):
                continue
            if node.op == "call_module":  # a BatchNorm still moves its running statistics
                keep = _is_batchnorm(self.layers.get(str(node.target)))
            else:
                keep = node.op == "call_function" and node.is_impure()
            if not keep:
                self.graph.erase_node(node)

    def nodes(self) -> list[fx.Node]:
        """The nodes that compute, in order (placeholders and the output left out)."""
        return [n for n in self.graph.nodes if n.op not in ("placeholder", "output")]

    def output_values(self) -> list[Any]:
        (out,) = [n for n in self.graph.nodes if n.op == "output"]
        return list(out.args[0])


def _lookup(model: nn.Module, fqn: str) -> Any:
    module_path, _, name = fqn.rpartition(".")
    owner = model.get_submodule(module_path) if module_path else model
    return getattr(owner, name)


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:  # export's own placeholders in the module stack
        return None


def _is_batchnorm(module: Any) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def _kept(module: Any) -> bool:
    return isinstance(module, nn.Module) and (_is_batchnorm(module) or uses_rng(module))


def _out_of_place_twin(node: fx.Node) -> Any:
    """``aten.relu.default`` for a node of ``aten.relu_.default`` (the op that changes only its
    first argument), else None."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):  # noqa: SLF001
        return None
    name = op.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_") or not node.args:
        return None
    writes = [bool(a.alias_info and a.alias_info.is_write) for a in op._schema.arguments]
    if writes[:1] != [True] or any(writes[1:]):
        return None
    twin = getattr(getattr(aten, name[:-1], None), op._overloadname, None)
    if twin is None or len(twin._schema.arguments) != len(writes):
        return None
    return twin


def _random(node: fx.Node) -> bool:
    target = node.target
    if target is _SDPA:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return bool(p)
    tags = getattr(target, "tags", ())
    return target in _DROPOUTS or torch.Tag.nondeterministic_seeded in tags


# ---- where to cut -------------------------------------------------------------------------


def repeated_blocks(model: nn.Module) -> list[list[str]]:
    """Groups of repeated blocks: the children of a ModuleList / Sequential (or a subclass) that
    share a class (transformer layers, residual blocks), outermost first. A container of plain
    containers (stages of blocks) is looked into; a block's insides are not blocks; groups of
    composite blocks win over groups of single layers (MobileNet's inverted residuals over its
    classifier's two Linear layers).

    >>> from torch import nn
    >>> model = nn.Module()
    >>> model.embed, model.head = nn.Embedding(10, 8), nn.Linear(8, 10)
    >>> model.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    >>> repeated_blocks(model)
    [['layers.0', 'layers.1', 'layers.2']]

    A torchvision ResNet-18 gives ``[['layer1.0', 'layer1.1'], ['layer2.0', 'layer2.1'], ...]``,
    a MobileNetV3-small ``[['features.0', 'features.1', 'features.2', ...], ...]``.
    """
    groups: list[list[str]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or _inside(name, taken):
            continue
        children = [(f"{name}.{c}" if name else c, m) for c, m in module.named_children()]
        kinds = [type(m) for _, m in children]
        # plain containers as children: stages of blocks (EfficientNet's, Swin's), looked into
        if len(children) < 2 or any(k in (nn.ModuleList, nn.Sequential) for k in kinds):
            continue
        if any(kinds.count(k) > 1 for k in kinds):
            groups.append([c for c, _ in children])
            taken.append(name)
    block_kinds = {type(model.get_submodule(c)) for group in groups for c in group}
    groups = [g for g in groups if not _within_kind(model, g[0], block_kinds)]
    composite = [g for g in groups if any(_has_children(model.get_submodule(c)) for c in g)]
    return composite or groups


def _within_kind(model: nn.Module, name: str, kinds: set[type]) -> bool:
    """Some module above ``name`` (not the root) is of one of ``kinds``."""
    parts = name.split(".")
    above = (".".join(parts[:i]) for i in range(1, len(parts) - 1))
    return any(type(model.get_submodule(path)) in kinds for path in above)


def _has_children(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _inside(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _paths(node: fx.Node) -> set[str]:
    return {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()}


def _cut_positions(
    graph: _Graph, model: nn.Module, split_points: Sequence[str] | None
) -> list[int]:
    """Positions in ``graph.nodes()`` where a piece starts: the first node of each split point's
    module call (and, for the repeated blocks, the first node after the last block)."""
    nodes = graph.nodes()
    paths = [_paths(n) for n in nodes]
    cuts: set[int] = set()
    groups = [list(split_points)] if split_points is not None else repeated_blocks(model)
    for group in groups:
        for name in group:
            hits = [i for i, p in enumerate(paths) if name in p]
            if not hits:
                raise CaptureError(
                    f"sequentialize: split point `{name}` is a submodule, but forward never "
                    "calls it on these inputs; pick a submodule that runs",
                    "split_points",
                )
            cuts.add(hits[0])
            if split_points is None and name == group[-1]:
                cuts.add(hits[-1] + 1)  # the head after the last block is a piece of its own
    return sorted(c for c in cuts if 0 < c < len(nodes))


def _spans(nodes: list[fx.Node], cuts: list[int]) -> list[frozenset[str]]:
    """Per piece, the submodule names whose calls its nodes belong to (from export's module
    stacks; the cuts' positions as :func:`_cut_positions` gives them)."""
    bounds = [0, *cuts, len(nodes)]
    return [
        frozenset(path for n in nodes[a:b] for path in _paths(n))
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def _check_split_point(model: nn.Module, name: str) -> None:
    try:
        model.get_submodule(name)
    except AttributeError:
        parent = name.rpartition(".")[0]
        try:
            siblings = [f"{parent}.{c}" if parent else c for c, _ in _children(model, parent)]
        except AttributeError:
            siblings = [c for c, _ in model.named_children()]
        raise CaptureError(
            f"sequentialize: split point `{name}` is not a submodule of "
            f"{type(model).__name__}; pick another split point, e.g. one of "
            f"{siblings[:8]} (model.named_modules() lists them)",
            "split_points",
        ) from None


def _children(model: nn.Module, path: str) -> Iterable[tuple[str, nn.Module]]:
    return (model.get_submodule(path) if path else model).named_children()


# ---- cutting ------------------------------------------------------------------------------


def _partition(graph: _Graph, cuts: list[int], tied: str) -> tuple[list[fx.GraphModule], list]:
    """The pieces, and for each cut the values that cross it (in graph order)."""
    nodes = graph.nodes()
    bounds = [0, *cuts, len(nodes)]
    last = len(bounds) - 2
    home: dict[fx.Node, int] = {n: 0 for n in graph.inputs}
    for p in range(last + 1):
        home.update((n, p) for n in nodes[bounds[p] : bounds[p + 1]])
    reach = _last_uses(graph, home, last)
    shared: dict[fx.Node, list[int]] = {}  # tied="share": held by each piece using it
    for attr, (fqn, obj) in graph.attrs.items():
        users = sorted({home[u] for u in attr.users if u in home})
        if users:
            home[attr] = users[0]
            if len(users) > 1 and isinstance(obj, nn.Parameter) and tied != "carry":
                if tied == "error":
                    raise CaptureError(_tied_message(fqn, attr, home, users), "tied")
                shared[attr] = users
                home[attr] = users[-1]  # never crosses a cut: every user holds it
    order = [n for n in graph.graph.nodes if n in home and n in reach]
    carried = [[v for v in order if home[v] < b <= reach[v]] for b in range(1, last + 1)]
    ins = [list(graph.inputs), *carried]
    outs = [*carried, graph.output_values()]
    pieces = [
        _Piece(graph, home, p, shared).build(nodes[bounds[p] : bounds[p + 1]], ins[p], outs[p])
        for p in range(last + 1)
    ]
    _attach_unused(pieces[0], graph.model, pieces)
    return pieces, carried


def _last_uses(graph: _Graph, home: dict[fx.Node, int], last: int) -> dict[fx.Node, int]:
    """The last piece that needs each value (the output counts as the last piece)."""
    reach: dict[fx.Node, int] = {}
    for node in graph.graph.nodes:
        for source in node.all_input_nodes:
            where = last if node.op == "output" else home.get(node, 0)
            reach[source] = max(reach.get(source, 0), where)
    return reach


def _tied_message(fqn: str, attr: fx.Node, home: dict[fx.Node, int], pieces: list[int]) -> str:
    users = sorted({p for u in attr.users for p in _paths(u) if u in home}, key=len)
    return (
        f"sequentialize: parameter `{fqn}` is used on both sides of a cut (pieces {pieces}, "
        f"by {users[-2:] if users else '?'}); pass tied='share' (the engine keeps the "
        "stages' copies tied) or tied='carry', untie it (e.g. "
        "config.tie_word_embeddings=False), or choose split points that keep its uses together"
    )


def device_of(tensor: torch.Tensor) -> torch.device:
    """The device a piece runs on: its first input's (what export fixed as the trace device)."""
    return tensor.device


class _Piece:
    """Builds one piece: a GraphModule taking one argument (a tensor or a tuple of values)."""

    def __init__(
        self, graph: _Graph, home: dict[fx.Node, int], index: int, shared: Mapping[fx.Node, Any]
    ) -> None:
        self.source, self.home, self.index, self.shared = graph, home, index, shared
        self.graph = fx.Graph()
        self.root = nn.Module()  # what the piece's get_attr / call_module targets name
        self.env: dict[fx.Node, fx.Node] = {}

    def build(self, nodes: list[fx.Node], ins: list[fx.Node], outs: list[Any]) -> fx.GraphModule:
        arg = self.graph.placeholder("inputs")
        for j, value in enumerate(ins):
            single = len(ins) == 1
            self.env[value] = (
                arg if single else self.graph.call_function(operator.getitem, (arg, j))
            )
        anchor = next((self.env[v] for v in ins if _is_tensor(v)), None)
        device = None
        if anchor is not None and any(_has_device(n) for n in nodes):
            device = self.graph.call_function(device_of, (anchor,))
        for node in nodes:
            self.env[node] = self.graph.node_copy(node, self.value)
            self._install(node)
            if device is not None:
                _retarget(self.env[node], device)
        results = [self._result(v, ins) for v in outs]
        self.graph.output(results[0] if len(results) == 1 else tuple(results))
        piece = fx.GraphModule(self.root, self.graph)
        return piece

    def value(self, node: fx.Node) -> fx.Node:
        """A node of this piece for a value of the captured graph."""
        if node in self.env:
            return self.env[node]
        held = self.home.get(node) == self.index or self.index in self.shared.get(node, ())
        if node in self.source.attrs and held:
            fqn, obj = self.source.attrs[node]
            _assign(self.root, fqn, obj, _persistent(self.source.model, fqn))
        elif node in self.source.constants:
            fqn = f"_constant_{node.name}"
            self.root.register_buffer(fqn, self.source.constants[node], persistent=False)
        else:
            raise CaptureError(
                f"sequentialize: value {node.name} is not available in piece {self.index}"
            )
        self.env[node] = self.graph.get_attr(fqn)
        self.env[node].meta = dict(node.meta)
        return self.env[node]

    def _install(self, node: fx.Node) -> None:
        if node.op == "call_module":
            _assign(self.root, str(node.target), self.source.layers[str(node.target)], True)
        elif node.op == "get_attr":  # a higher-order op's body (a graph module of its own)
            _assign(self.root, str(node.target), _lookup(self.source.owner, str(node.target)), True)

    def _result(self, value: Any, ins: list[fx.Node]) -> Any:
        if not isinstance(value, fx.Node):
            return value
        node = self.value(value)
        # A float value handed on untouched (a carried parameter, a skipped hidden state) gets
        # a node of its own, so each stage's output has a grad_fn of its own.
        if (value in ins or value in self.source.attrs) and _is_float(value):
            node = self.graph.call_function(aten.alias.default, (node,))
        return node


def _is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _is_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _has_device(node: fx.Node) -> bool:
    found: list[bool] = []
    fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: found.append(isinstance(a, torch.device))
    )
    return any(found)


def _retarget(node: fx.Node, device: fx.Node) -> None:
    """Ops that create tensors on the trace device create them where the piece runs."""

    def swap(a: Any) -> Any:
        return device if isinstance(a, torch.device) else a

    node.args = fx.node.map_aggregate(node.args, swap)
    node.kwargs = fx.node.map_aggregate(node.kwargs, swap)


def _persistent(model: nn.Module, fqn: str) -> bool:
    path, _, name = fqn.rpartition(".")
    owner = model.get_submodule(path) if path else model
    return name not in owner._non_persistent_buffers_set  # noqa: SLF001


def _assign(root: nn.Module, fqn: str, obj: Any, persistent: bool) -> None:
    """Sets ``root.<fqn>`` to ``obj``, making the intermediate modules (names kept)."""
    *path, name = fqn.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    if isinstance(obj, nn.Parameter):
        root.register_parameter(name, obj)
    elif isinstance(obj, torch.Tensor):
        root.register_buffer(name, obj, persistent=persistent)
    elif isinstance(obj, nn.Module):
        root.add_module(name, obj)
    else:
        setattr(root, name, obj)


def _attach_unused(first: nn.Module, model: nn.Module, pieces: list[fx.GraphModule]) -> None:
    """State forward never touches still belongs to the model (and to its checkpoints)."""
    held = {id(t) for p in pieces for t in p.state_dict(keep_vars=True).values()}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in held:
            _assign(first, name, tensor, True)
            held.add(id(tensor))
