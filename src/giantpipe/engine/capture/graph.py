"""The export graph: ``model``'s forward captured by ``torch.export`` (non-strict, shapes kept
symbolic), then prepared for cutting.

Parameters are resolved to the model's own objects, assertions dropped, BatchNorm and
dropout-like modules kept as layers, other random ops made :class:`RandomOp` layers, in-place
ops made out-of-place where nothing can tell. What cannot be captured is a :class:`CaptureError`
naming the submodule.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from giantpipe.engine.rng import uses_rng

__all__ = ["CaptureError", "RandomOp"]

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


def _with_defaults(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face model would return its key/value cache, which no pipeline carries."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params and "use_cache" not in kwargs:
        return {**kwargs, "use_cache": False}
    return dict(kwargs)


DYNAMIC = ("all", "batch")
"""Which input dimensions a capture keeps symbolic: every one, or the batch (the first) alone."""


def _dynamic_shapes(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: str = "all"
) -> Any:
    """``all``: every tensor dimension may vary (export keeps symbolic what the code allows);
    ``batch``: the first only. Symbolic image sizes cost torch.export much sympy reasoning
    (Swin-T at 32 pixels: 122 CPU s captured with ``all``, 5 s with ``batch``)."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return None
        dims = range(value.dim()) if dynamic == "all" else range(min(1, value.dim()))
        return {d: torch.export.Dim.AUTO for d in dims}

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: str = "all"
) -> Any:
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
        with _buffers_on_meta(model):
            return torch.export.export(
                model,
                args,
                kwargs,
                dynamic_shapes=_dynamic_shapes(model, args, kwargs, dynamic),
                strict=False,
            )
    except Exception as exc:  # noqa: BLE001 - any capture failure becomes one message
        raise CaptureError(_capture_failure(exc, model)) from exc
    finally:
        for module, mode in modes.items():
            module.training = mode


@contextmanager
def _buffers_on_meta(model: nn.Module) -> Iterator[None]:
    """A model whose parameters are on meta (built without them) is traced on meta alone: its
    real buffers (BatchNorm statistics, position tables) are lent meta copies for the trace;
    the pieces take the real ones back, resolved by name after it."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        yield
        return
    real = [
        (module, name, buf)
        for module in model.modules()
        for name, buf in module._buffers.items()  # noqa: SLF001
        if buf is not None and buf.device.type != "meta"
    ]
    for module, name, buf in real:
        module._buffers[name] = buf.to("meta")  # noqa: SLF001
    try:
        yield
    finally:
        for module, name, buf in real:
            module._buffers[name] = buf  # noqa: SLF001


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
