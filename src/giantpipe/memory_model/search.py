"""The largest model that trains in a memory budget per device: search, then measure.

1. Profile: each layer of a small template model (AmoebaNet-D (9, D), Transformer-L with one
   layer) is run once under fake tensors for one micro-batch (:func:`profile_layers`). A model
   of depth L repeats the template's layers (``family.expand``): cells of one stack are
   identical from the third on, Transformer layers all are.
2. Predict: for each width D, the deepest L whose best balance (:func:`balance_memory`, cut by
   ``solve_balance``) keeps every predicted stage peak under the budget (binary search on L).
3. Measure: the best candidate is built on the meta device and each of its stages runs a real
   training step with the engine (:func:`measure_stage`). If a stage is over budget after all,
   the next smaller candidate is measured. Every reported number comes from step 3.

Example::

    family = AmoebaNetD(batch=128)
    setting = Setting("Pipeline-2", partitions=2, chunks=128, checkpoint="always")
    plan = search(family, [setting], budget=8 * 2**30, widths=[256, 512])
    result = confirm(family, plan, budget=8 * 2**30)
    result.stages[0].peak
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from giantpipe.memory_model.layers import LayerCost, balance_memory, profile_layers, stage_peaks
from giantpipe.memory_model.specs import Spec, TensorSpec
from giantpipe.memory_model.stage import StageLoss, StageMemory, measure_stage
from models.amoebanet import amoebanetd
from models.transformer import transformer_lm


@dataclass(frozen=True)
class Setting:
    """One column of Table 1: K partitions, M micro-batches, re-materialization mode."""

    label: str
    partitions: int
    chunks: int
    checkpoint: str
    schedule: str = "gpipe"


@dataclass(frozen=True)
class Plan:
    """A model size with its balance and predicted stage peaks (bytes)."""

    setting: Setting
    layers: int
    width: int
    params: int
    balance: tuple[int, ...]
    predicted: tuple[int, ...]


@dataclass
class Result:
    """A plan and its stages as measured by running the engine."""

    plan: Plan
    stages: list[StageMemory]
    tried: list[str] = field(default_factory=list)  # plans measured over budget first

    @property
    def peak(self) -> int:
        """The largest stage peak: what each device must hold."""
        return max(s.peak for s in self.stages)


class AmoebaNetD:
    """AmoebaNet-D (L, D) at ``image_size`` px; L a multiple of 3, at least 6.

    Template (9, D): stem, reduce1, reduce2, 3 normal cells, reduce3, 3 normal, reduce4,
    3 normal, classifier. The first two cells of a stack differ from the rest (their
    "previous" input comes from before the stack), the rest are identical.
    """

    name = "AmoebaNet-D"

    def __init__(self, batch: int = 128, image_size: int = 224, classes: int = 1000) -> None:
        self.batch, self.image_size, self.classes = batch, image_size, classes

    def build(self, layers: int, width: int) -> nn.Sequential:
        with torch.device("meta"):
            return amoebanetd(layers, width, self.classes, self.image_size)

    def template(self, width: int) -> nn.Sequential:
        return self.build(9, width)

    def expand(self, layers: int) -> list[int]:
        """Template index of each of the L + 6 layers.

        >>> AmoebaNetD().expand(12)
        [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 13, 14]
        """
        if layers < 6 or layers % 3:
            raise ValueError(f"AmoebaNet-D needs L a multiple of 3 and >= 6, got {layers}")
        more = layers // 3 - 2
        return [0, 1, 2, 3, 4, *[5] * more, 6, 7, 8, *[9] * more, 10, 11, 12, *[13] * more, 14]

    def input(self, micro: int) -> Spec:
        return TensorSpec((micro, 3, self.image_size, self.image_size), torch.float32)

    def loss(self, micro: int) -> StageLoss:
        return StageLoss(F.cross_entropy, TensorSpec((micro,), torch.long))

    def describe(self, layers: int, width: int) -> str:
        return f"({layers},{width})"


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of [B, T, V] logits against [B, T] ids."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class TransformerL:
    """Transformer-L of Table 1 (d_model 2048, FFN 8192, 32 heads, vocab 32k, 1024 tokens).

    There is one width; ``width`` is the model dimension, kept for the common interface.
    """

    name = "Transformer-L"

    def __init__(self, batch: int = 32, seq_len: int = 1024, d_model: int = 2048) -> None:
        self.batch, self.seq_len, self.d_model = batch, seq_len, d_model

    def build(self, layers: int, width: int) -> nn.Sequential:
        with torch.device("meta"):
            return transformer_lm(
                layers, d_model=width, ffn_dim=4 * width, num_heads=width // 64,
                max_len=self.seq_len,
            )  # fmt: skip

    def template(self, width: int) -> nn.Sequential:
        return self.build(1, width)

    def expand(self, layers: int) -> list[int]:
        """[embedding, L layers, softmax head]; ``TransformerL().expand(2) == [0, 1, 1, 2]``."""
        return [0, *[1] * layers, 2]

    def input(self, micro: int) -> Spec:
        return TensorSpec((micro, self.seq_len), torch.long)

    def loss(self, micro: int) -> StageLoss:
        return StageLoss(lm_loss, TensorSpec((micro, self.seq_len), torch.long))

    def describe(self, layers: int, width: int) -> str:
        return str(layers)


Family = AmoebaNetD | TransformerL


def micro_batch(family: Family, setting: Setting) -> int:
    """Samples per micro-batch; M must divide the batch (all micro-batches the same size)."""
    if family.batch % setting.chunks:
        raise ValueError(f"{setting.label}: M={setting.chunks} does not divide {family.batch}")
    return family.batch // setting.chunks


@functools.lru_cache(maxsize=256)
def template_costs(family: Family, width: int, micro: int, optimizer: str) -> list[LayerCost]:
    """Per-layer costs of ``family``'s template at ``width`` for a micro-batch (cached)."""
    model = family.template(width)
    return profile_layers(model, family.input(micro), family.loss(micro), optimizer)


@functools.lru_cache(maxsize=4096)
def predict(
    family: Family, setting: Setting, layers: int, width: int, optimizer: str
) -> Plan | None:
    """The balance of an (L, D) model and its predicted stage peaks; None if it can't be cut."""
    template = template_costs(family, width, micro_batch(family, setting), optimizer)
    costs = [template[i] for i in family.expand(layers)]
    if len(costs) < setting.partitions:
        return None
    balance = balance_memory(costs, setting.partitions, setting.chunks, setting.checkpoint)
    peaks = stage_peaks(costs, balance, setting.chunks, setting.checkpoint)
    params = sum(c.params for c in costs)
    return Plan(setting, layers, width, params, tuple(balance), tuple(peaks))


def _fits(plan: Plan | None, budget: int) -> bool:
    return plan is not None and max(plan.predicted) <= budget


def deepest(
    family: Family,
    setting: Setting,
    width: int,
    depths: Sequence[int],
    budget: int,
    optimizer: str,
    beat: int = 0,
) -> Plan | None:
    """The deepest plan among ``depths`` (ascending) predicted to fit, by binary search;
    None if no depth fits with more than ``beat`` parameters."""
    template = template_costs(family, width, micro_batch(family, setting), optimizer)

    def params(layers: int) -> int:
        return sum(template[i].params for i in family.expand(layers))

    def fits(layers: int) -> bool:
        return _fits(predict(family, setting, layers, width, optimizer), budget)

    usable = [d for d in depths if len(family.expand(d)) >= setting.partitions]
    # Parameters grow with depth: skip the depths that cannot beat the best plan so far.
    low = bisect.bisect_right(range(len(usable)), beat, key=lambda i: params(usable[i]))
    if low == len(usable) or not fits(usable[low]):
        return None
    # Deeper never fits better: find the first depth that does not fit.
    rest = range(low + 1, len(usable))
    cut = low + 1 + bisect.bisect_left(rest, True, key=lambda i: not fits(usable[i]))
    return predict(family, setting, usable[cut - 1], width, optimizer)


def search(
    family: Family,
    settings: Sequence[Setting],
    budget: int,
    widths: Sequence[int],
    depths: Sequence[int],
    optimizer: str = "rmsprop",
    refine: int = 0,
) -> list[Plan]:
    """Candidate plans, largest predicted first: each is the deepest fit of a setting and a
    width that beats every plan found before it.

    Settings with more micro-batches go first (they usually need less memory, so later ones
    are mostly ruled out with one prediction). Widths are tried in ascending order until none
    fits at the smallest depth (wider only costs more) or two in a row cannot beat the best.
    With ``refine`` > 0, widths within ``3 * refine`` of the best are added in steps of
    ``refine`` for the best setting (a coarse-to-fine search over D).
    """
    plans: list[Plan] = []
    best = 0
    order = sorted(settings, key=lambda s: (-s.chunks, s.checkpoint != "except_last"))
    for setting in order:
        worse = 0
        shallowest = next(d for d in depths if len(family.expand(d)) >= setting.partitions)
        for width in sorted(widths):
            if not _fits(predict(family, setting, shallowest, width, optimizer), budget):
                break
            plan = deepest(family, setting, width, depths, budget, optimizer, beat=best)
            worse = 0 if plan is not None else worse + 1
            if plan is not None:
                plans.append(plan)
                best = plan.params
            if worse == 2:
                break
    if refine and plans:
        top = max(plans, key=_size)
        near = range(max(refine, top.width - 3 * refine), top.width + 3 * refine + 1, refine)
        for width in sorted(set(near) - set(widths)):
            found = deepest(family, top.setting, width, depths, budget, optimizer, beat=best)
            if found is not None:
                plans.append(found)
                best = found.params
    return sorted(plans, key=_size, reverse=True)


def _size(plan: Plan) -> tuple[int, bool, int]:
    # Most parameters; on a tie, no recomputation of the last micro-batch, then fewer chunks.
    return plan.params, plan.setting.checkpoint == "except_last", -plan.setting.chunks


def measure_plan(family: Family, plan: Plan, optimizer: str = "rmsprop") -> list[StageMemory]:
    """Runs one training step of every stage of ``plan`` with the engine (see stage.py).

    Stages made of the same template layers (most Transformer stages) are measured once.
    """
    setting = plan.setting
    micro = micro_batch(family, setting)
    model = family.build(plan.layers, plan.width)
    index = family.expand(plan.layers)
    template = template_costs(family, plan.width, micro, optimizer)
    measured: dict[tuple[object, ...], StageMemory] = {}
    stages, start = [], 0
    for k, count in enumerate(plan.balance):
        last = k == len(plan.balance) - 1
        # Under fill-drain every stage runs the same action list; other schedules do not.
        position = (k == 0, last) if setting.schedule == "gpipe" else (k,)
        key = (tuple(index[start : start + count]), *position)
        if key not in measured:
            measured[key] = measure_stage(
                model[start : start + count],
                template[index[start]].spec,
                chunks=setting.chunks,
                checkpoint=setting.checkpoint,
                schedule=setting.schedule,
                stage_index=k,
                num_stages=len(plan.balance),
                loss=family.loss(micro) if last else None,
                optimizer=optimizer,
            )
        stages.append(measured[key])
        start += count
    return stages


def confirm(
    family: Family,
    plans: Sequence[Plan],
    budget: int,
    optimizer: str = "rmsprop",
    step: int = 1,
    tries: int = 4,
) -> Result:
    """Measures candidates, largest first, until one fits; a plan over budget is retried
    ``step`` layers shallower. Raises if none of ``tries`` measured plans fits."""
    queue = list(plans)
    tried: list[str] = []
    for _ in range(tries):
        if not queue:
            break
        plan = queue.pop(0)
        stages = measure_plan(family, plan, optimizer)
        if max(s.peak for s in stages) <= budget:
            return Result(plan, stages, tried)
        setting = plan.setting
        tried.append(
            f"{family.describe(plan.layers, plan.width)} at M={setting.chunks} "
            f"{setting.checkpoint}: {max(s.peak for s in stages) / 2**30:.2f} GiB"
        )
        smaller = predict(family, plan.setting, plan.layers - step, plan.width, optimizer)
        if smaller is not None and plan.layers - step > 0:
            queue.append(smaller)
            queue.sort(key=_size, reverse=True)
    raise RuntimeError(f"no candidate fits {budget / 2**30:.1f} GiB after measuring {tried}")
