"""The largest model that trains in a memory budget per device: predict, search, measure.

Each layer of a small template is profiled under fake tensors, the deepest model per width
whose stage peaks fit is searched, and the best is confirmed by measuring its stages; the model
families live with recipes/model_sizes.py (docs/performance.md#sizing-the-largest-model).

Example::

    family = AmoebaNetD(batch=128)          # recipes/model_sizes.py
    setting = Setting.uncut("Pipeline-2", 2, chunks=128, recompute="always")
    sizes = search(family, [setting], budget=8 * 2**30, widths=[256, 512], depths=range(6, 200, 6))
    confirmed = confirm(family, sizes, budget=8 * 2**30)
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from torch import nn

from giantpipe.engine.spec import PipelineSpec
from giantpipe.perf.balance import solve_balance
from giantpipe.perf.memory import Spec, StageLoss
from giantpipe.perf.replica_state import ReplicaSharding, keeps_units
from giantpipe.perf.stage_memory import (
    LayerMemory,
    StageMemory,
    measure_stage,
    profile_layer_memory,
)


class ModelFamily(Protocol):
    """Models of one kind in every size (L layers, width D), as the search builds them."""

    name: str
    batch: int  # the mini-batch; M micro-batches split it evenly

    def build(self, layers: int, width: int) -> nn.Sequential:
        """The model of size (L, D) on the meta device."""
        ...

    def template(self, width: int) -> nn.Sequential:
        """A small model of width D whose layers every size repeats (see :meth:`expand`)."""
        ...

    def expand(self, layers: int) -> list[int]:
        """The template layer that each layer of the L-layer model repeats."""
        ...

    def input(self, micro: int) -> Spec:
        """The model's input for a micro-batch of ``micro`` samples."""
        ...

    def loss(self, micro: int) -> StageLoss:
        """The loss after the last layer, for a micro-batch of ``micro`` samples."""
        ...

    def describe(self, layers: int, width: int) -> str:
        """The size as the paper writes it: ``(18,208)``, or ``13`` layers."""
        ...

    def __hash__(self) -> int:
        """Predictions are cached per family (by identity, as objects hash by default)."""
        ...


@dataclass(frozen=True)
class Setting:
    """One column of Table 1: a label beside the pipeline's shape.

    The shape is the engine's own :class:`~giantpipe.engine.spec.PipelineSpec` (K stages, M,
    schedule, re-materialization), so a column is sized with exactly what a pipe would run.
    Before a model is cut its balance only counts the stages (:meth:`uncut`); each sized model
    carries the spec with its real cut (:attr:`ModelSize.spec`).

    >>> setting = Setting.uncut("Pipeline-2", 2, chunks=32, recompute="always")
    >>> setting.spec.num_stages, setting.spec.chunks, setting.spec.recompute
    (2, 32, 'always')
    """

    label: str
    spec: PipelineSpec
    replicas: ReplicaSharding = ReplicaSharding()
    """R replicas of every stage on FSDP2 (default one): K x R devices, each stage's state
    spread as :mod:`giantpipe.perf.replica_state` says (predicted only: :func:`measure_size`
    runs each stage alone)."""

    @classmethod
    def uncut(
        cls, label: str, partitions: int, replicas: ReplicaSharding | None = None, **shape: Any
    ) -> Setting:
        """``partitions`` stages, not yet cut (one layer each); ``shape``: the spec's other
        keywords (``chunks``, ``recompute``, ``schedule``); ``replicas``: see above."""
        spec = PipelineSpec.from_keywords(balance=(1,) * partitions, **shape)
        sharding = replicas or ReplicaSharding()
        return cls(label, spec, replace(sharding, split=keeps_units(spec.schedule)))


@dataclass(frozen=True)
class ModelSize:
    """A model size (L, D) in a setting, with its cut and predicted stage peaks (bytes)."""

    setting: Setting
    layers: int
    width: int
    params: int
    spec: PipelineSpec  # the setting's spec with this model's balance
    predicted: tuple[int, ...]

    @property
    def balance(self) -> tuple[int, ...]:
        """Layers per stage of this model's cut."""
        return self.spec.balance


@dataclass
class MeasuredSize:
    """A model size and its stages as measured by running the engine."""

    size: ModelSize
    stages: list[StageMemory]
    tried: list[str] = field(default_factory=list)  # sizes measured over budget first

    @property
    def peak(self) -> int:
        """The largest stage peak: what each device must hold."""
        return max(s.peak for s in self.stages)


def stage_peaks(
    costs: Sequence[LayerMemory],
    balance: Sequence[int],
    chunks: int,
    recompute: str,
    replicas: ReplicaSharding | None = None,
) -> list[int]:
    """Predicted peak bytes of each stage (the sum: docs/performance.md#sizing-the-largest-model)
    under the re-materialization mode ``recompute`` ('always', 'except_last' or 'never'), each stage
    spread over ``replicas`` (default: one).

    Example::

        stage_peaks(template_memory(family, 208, 4, "rmsprop"), [7, 8], 32, "always")
    """
    peaks, start = [], 0
    sharding = replicas or ReplicaSharding()
    for count in balance:
        layers = costs[start : start + count]
        others = 0 if recompute != "never" else (chunks - 1) * sum(c.saved for c in layers)
        peaks.append(
            sum(resident(c, sharding) for c in layers)
            + sharding.gathered_bytes(max(c.weights for c in layers))
            + chunks * layers[0].input
            + others
            + _backward_peak(layers)
        )
        start += count
    return peaks


def resident(layer: LayerMemory, replicas: ReplicaSharding) -> int:
    """A layer's resident bytes (weights, gradients, optimizer slots, buffers) at the step's
    peak on one rank, its state spread over ``replicas``."""
    unsharded = (2 + layer.slots) * layer.weights
    return int(layer.resident - unsharded + replicas.layer_bytes(layer.weights, layer.slots))


def _backward_peak(layers: Sequence[LayerMemory]) -> int:
    # Backward walks the stage from its last layer to its first; while layer j runs backward,
    # the later layers' saved tensors are already freed, the earlier ones' still held.
    held, peak = 0, 0
    for c in layers:
        held += c.saved
        peak = max(peak, held + c.transient)
    return peak


def balance_memory(
    costs: Sequence[LayerMemory],
    partitions: int,
    chunks: int,
    recompute: str,
    replicas: ReplicaSharding | None = None,
) -> list[int]:
    """A balance minimising the predicted largest stage peak, cut by ``solve_balance``.

    A stage's peak is not a sum of per-layer costs (its first layer's input is stored M
    times), so two additive costs are tried: resident + saved, and the same plus M x input
    (as if any layer could start a stage); the balance with the lower predicted peak wins.

    Example::

        balance_memory(template_memory(family, 208, 4, "rmsprop"), 2, 32, "always")   # [7, 8]
    """
    sharding = replicas or ReplicaSharding()
    # a layer may free more than it saves
    base = [max(0, resident(c, sharding) + c.saved) for c in costs]
    candidates = [solve_balance(base, partitions)]
    if len({c.input for c in costs[1:]}) > 1:  # equal inputs add the same to every cut
        with_inputs = [b + chunks * c.input for b, c in zip(base, costs)]
        candidates.append(solve_balance(with_inputs, partitions))
    return min(candidates, key=lambda b: max(stage_peaks(costs, b, chunks, recompute, sharding)))


def micro_batch(family: ModelFamily, setting: Setting) -> int:
    """Samples per micro-batch; M must divide the batch (all micro-batches the same size)."""
    chunks = setting.spec.chunks
    if family.batch % chunks:
        raise ValueError(f"{setting.label}: M={chunks} does not divide {family.batch}")
    return family.batch // chunks


@functools.lru_cache(maxsize=256)
def template_memory(
    family: ModelFamily, width: int, micro: int, optimizer: str
) -> list[LayerMemory]:
    """Per-layer bytes of ``family``'s template at ``width`` for a micro-batch (cached)."""
    model = family.template(width)
    return profile_layer_memory(model, family.input(micro), family.loss(micro), optimizer)


@functools.lru_cache(maxsize=4096)
def size_model(
    family: ModelFamily, setting: Setting, layers: int, width: int, optimizer: str
) -> ModelSize | None:
    """Sizes an (L, D) model: its balance and predicted stage peaks; None if it can't be cut.

    Example::

        setting = Setting.uncut("Pipeline-8", 8, chunks=32, recompute="always")
        size = size_model(AmoebaNetD(), setting, 72, 512, "rmsprop")
        max(size.predicted) / 2**30   # GiB on the fullest device
    """
    template = template_memory(family, width, micro_batch(family, setting), optimizer)
    costs = [template[i] for i in family.expand(layers)]
    shape = setting.spec
    if len(costs) < shape.num_stages:
        return None
    sharding = setting.replicas
    balance = balance_memory(costs, shape.num_stages, shape.chunks, shape.recompute, sharding)
    peaks = stage_peaks(costs, balance, shape.chunks, shape.recompute, sharding)
    params = sum(c.params for c in costs)
    cut = shape.replace(balance=tuple(balance))
    return ModelSize(setting, layers, width, params, cut, tuple(peaks))


def _fits(size: ModelSize | None, budget: int) -> bool:
    return size is not None and max(size.predicted) <= budget


def deepest(
    family: ModelFamily,
    setting: Setting,
    width: int,
    depths: Sequence[int],
    budget: int,
    optimizer: str,
    beat: int = 0,
) -> ModelSize | None:
    """The deepest size among ``depths`` (ascending) predicted to fit, by binary search;
    None if no depth fits with more than ``beat`` parameters.

    Example::

        deepest(AmoebaNetD(), setting, 512, range(6, 200, 6), 8 * 2**30, "rmsprop").layers
    """
    template = template_memory(family, width, micro_batch(family, setting), optimizer)

    def params(layers: int) -> int:
        return sum(template[i].params for i in family.expand(layers))

    def fits(layers: int) -> bool:
        return _fits(size_model(family, setting, layers, width, optimizer), budget)

    usable = [d for d in depths if len(family.expand(d)) >= setting.spec.num_stages]
    # Parameters grow with depth: skip the depths that cannot beat the best size so far.
    low = bisect.bisect_right(range(len(usable)), beat, key=lambda i: params(usable[i]))
    if low == len(usable) or not fits(usable[low]):
        return None
    # Deeper never fits better: find the first depth that does not fit.
    rest = range(low + 1, len(usable))
    cut = low + 1 + bisect.bisect_left(rest, True, key=lambda i: not fits(usable[i]))
    return size_model(family, setting, usable[cut - 1], width, optimizer)


def search(
    family: ModelFamily,
    settings: Sequence[Setting],
    budget: int,
    widths: Sequence[int],
    depths: Sequence[int],
    optimizer: str = "rmsprop",
    refine: int = 0,
) -> list[ModelSize]:
    """Candidate sizes, largest predicted first: each is the deepest fit of a setting and a
    width that beats every size found before it.

    Settings with more micro-batches go first (they usually need less memory, so later ones
    are mostly ruled out with one prediction). Widths are tried in ascending order until none
    fits at the smallest depth (wider only costs more) or two in a row cannot beat the best.
    With ``refine`` > 0, widths within ``3 * refine`` of the best are added in steps of
    ``refine`` for the best setting (a coarse-to-fine search over D). Example: see the module.
    """
    sizes: list[ModelSize] = []
    best = 0
    order = sorted(settings, key=lambda s: (-s.spec.chunks, s.spec.recompute != "except_last"))
    for setting in order:
        worse = 0
        stages = setting.spec.num_stages
        shallowest = next(d for d in depths if len(family.expand(d)) >= stages)
        for width in sorted(widths):
            if not _fits(size_model(family, setting, shallowest, width, optimizer), budget):
                break
            size = deepest(family, setting, width, depths, budget, optimizer, beat=best)
            worse = 0 if size is not None else worse + 1
            if size is not None:
                sizes.append(size)
                best = size.params
            if worse == 2:
                break
    if refine and sizes:
        top = max(sizes, key=_rank)
        near = range(max(refine, top.width - 3 * refine), top.width + 3 * refine + 1, refine)
        for width in sorted(set(near) - set(widths)):
            found = deepest(family, top.setting, width, depths, budget, optimizer, beat=best)
            if found is not None:
                sizes.append(found)
                best = found.params
    return sorted(sizes, key=_rank, reverse=True)


def _rank(size: ModelSize) -> tuple[int, bool, int]:
    # Most parameters; on a tie, no recomputation of the last micro-batch, then fewer chunks.
    return size.params, size.spec.recompute == "except_last", -size.spec.chunks


def measure_size(
    family: ModelFamily, size: ModelSize, optimizer: str = "rmsprop"
) -> list[StageMemory]:
    """Runs one training step of every stage of ``size`` with the engine (``measure_stage``).

    Stages made of the same template layers (most Transformer stages) are measured once.

    Example::

        stages = measure_size(family, size)
        max(s.peak for s in stages) / 2**30   # GiB, measured
    """
    spec = size.spec
    micro = micro_batch(family, size.setting)
    model = family.build(size.layers, size.width)
    index = family.expand(size.layers)
    template = template_memory(family, size.width, micro, optimizer)
    measured: dict[tuple[object, ...], StageMemory] = {}
    stages, start = [], 0
    for k, count in enumerate(size.balance):
        last = k == len(size.balance) - 1
        # Under fill-drain every stage runs the same action list; other schedules do not.
        position = (k == 0, last) if spec.schedule == "gpipe" else (k,)
        key = (tuple(index[start : start + count]), *position)
        if key not in measured:
            measured[key] = measure_stage(
                model[start : start + count],
                template[index[start]].spec,
                chunks=spec.chunks,
                recompute=spec.recompute,
                schedule=spec.schedule,
                stage_index=k,
                num_stages=len(size.balance),
                loss=family.loss(micro) if last else None,
                optimizer=optimizer,
            )
        stages.append(measured[key])
        start += count
    return stages


def confirm(
    family: ModelFamily,
    sizes: Sequence[ModelSize],
    budget: int,
    optimizer: str = "rmsprop",
    step: int = 1,
    tries: int = 4,
) -> MeasuredSize:
    """Measures candidates, largest first, until one fits; a size over budget is retried
    ``step`` layers shallower. Raises if none of ``tries`` measured sizes fits.

    Example::

        confirmed = confirm(family, search(family, settings, budget, widths, depths), budget)
        confirmed.size.params, confirmed.peak
    """
    queue = list(sizes)
    tried: list[str] = []
    for _ in range(tries):
        if not queue:
            break
        size = queue.pop(0)
        stages = measure_size(family, size, optimizer)
        if max(s.peak for s in stages) <= budget:
            return MeasuredSize(size, stages, tried)
        tried.append(
            f"{family.describe(size.layers, size.width)} at M={size.spec.chunks} "
            f"{size.spec.recompute}: {max(s.peak for s in stages) / 2**30:.2f} GiB"
        )
        smaller = size_model(family, size.setting, size.layers - step, size.width, optimizer)
        if smaller is not None and size.layers - step > 0:
            queue.append(smaller)
            queue.sort(key=_rank, reverse=True)
    raise RuntimeError(f"no candidate fits {budget / 2**30:.1f} GiB after measuring {tried}")
