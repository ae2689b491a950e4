"""The contract between a data builder and the runner: a :class:`DataBundle`.

Batches are ``(inputs, targets)`` pairs, training batches a pure function of ``(seed,
position)`` (a resume asks again from the saved position); token losses set
``loss_normalizer``, ``ignore_index`` and ``tokens_per_batch``; ``evaluate_model`` gives figures
beyond the loss (docs/your-data.md#a-whole-model-evaluation-of-your-own).

Example::

    bundle = DataBundle(
        train_batches=lambda seed, position: my_stream(seed, start=position),
        eval_batches=lambda: my_eval_loader,
        batches_per_epoch=len(my_train_set) // 64, loss="cross_entropy", metric="accuracy",
    )
    inputs, targets = next(bundle.train_batches(seed=0, position=0))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from giantpipe.engine.inference import PipedModel

Tensors = Tensor | tuple[Tensor, ...]
Batch = tuple[Tensors, Tensors]

LOSSES = ("cross_entropy", "mse")
METRICS = ("accuracy", "top5")
"""``accuracy``: top-1; ``top5``: top-1 (``accuracy``) and top-5 (``top5``), as ImageNet reports."""


@dataclass
class DataBundle:
    """Everything the runner needs from a data set."""

    train_batches: Callable[[int, int], Iterator[Batch]]
    """(seed, position) -> endless iterator of training batches, starting at batch ``position``."""
    eval_batches: Callable[[], Iterable[Batch]]
    """() -> a fresh pass over the evaluation batches."""
    batches_per_epoch: int
    """Training batches in one epoch (converts epoch-valued settings to steps)."""
    loss: str = "cross_entropy"
    """``cross_entropy`` (class-index targets, last dim of the output is the class) or ``mse``."""
    metric: str | None = "accuracy"
    """Extra evaluation metric besides the loss: ``accuracy``, ``top5`` (top-1 and -5) or None."""
    ignore_index: int | None = None
    """Target value left out of the loss and the metric (padding)."""
    loss_normalizer: Callable[[Any], float] | None = None
    """targets -> the number the summed loss is divided by (e.g. non-pad tokens); None: mean."""
    tokens_per_batch: Callable[[Batch], int] | None = None
    """batch -> tokens in it, for tokens/s; None when tokens do not apply."""
    evaluate_model: Callable[[PipedModel], dict[str, float | str]] | None = None
    """model -> extra evaluation figures (e.g. ``{"bleu": 31.2, "bleu/en-de": 29.8}``), called
    with the pipe as its whole model on every process (the same calls everywhere: they are
    collective); strings (e.g. a sacreBLEU signature) go to the log and the summary, numbers to
    the metrics too. It raises :class:`EvaluationError` (naming the evaluation set) when it
    fails. A hook that decodes says so, ``generates = True``: the model's children must then
    keep key/value caches, checked before training."""
    eval_set: str = "the evaluation batches"
    """What the evaluation batches are read from (e.g. ``valid.tsv``, ``DIR/val``), for messages
    such as an evaluation error's."""
    fixed_shape: bool = False
    """Every input has one shape but for the batch size (images, feature vectors): a captured
    model then keeps only the batch dimension symbolic (``sequentialize(dynamic="batch")``)."""

    _first: dict[int, Batch] = field(default_factory=dict, init=False, repr=False, compare=False)

    def first_batch(self, seed: int) -> Batch:
        """The first training batch of ``seed``: what capture, sizing and planning sample.

        Read once, and its iterator closed at once: a DataLoader's workers are forked once and
        shut down here, not by the garbage collector while later loaders fork theirs (a fork
        while another thread exits can leave a worker waiting on a lock forever)."""
        if seed not in self._first:
            batches = self.train_batches(seed, 0)
            try:
                self._first[seed] = next(batches)
            finally:
                close = getattr(batches, "close", None)
                if callable(close):
                    close()
        return self._first[seed]

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"DataBundle.loss must be one of {LOSSES}, got {self.loss!r}")
        if self.metric is not None and self.metric not in METRICS:
            raise ValueError(f"DataBundle.metric must be one of {METRICS} or None")
        if self.batches_per_epoch < 1:
            raise ValueError("DataBundle.batches_per_epoch must be >= 1")


class EvaluationError(RuntimeError):
    """An evaluation that failed on the data's side; the message names the evaluation set.

    Example::

        raise EvaluationError("valid.tsv", "BLEU decoding failed: ...")
        # EvaluationError: evaluation on valid.tsv: BLEU decoding failed: ...
    """

    def __init__(self, eval_set: str, problem: str) -> None:
        super().__init__(f"evaluation on {eval_set}: {problem}")
        self.eval_set, self.problem = eval_set, problem


def batch_size(tensors: Tensors) -> int:
    """Samples in a batch: the first dimension of the (first) tensor.

    Example::

        batch_size((torch.zeros(8, 3), torch.zeros(8)))  # 8
    """
    first = tensors[0] if isinstance(tensors, tuple) else tensors
    return int(first.shape[0])
