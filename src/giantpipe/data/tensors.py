"""Data sets held in memory as tensors: generated ones for quick starts, tests and throughput
tables, and your own ``train.pt`` / ``eval.pt``; three ``data=`` options and the seeded batch
order they share.

- ``data=synthetic`` (:func:`classification`): standard normal vectors labelled by a fixed random
  "teacher" network (tanh hidden layer, argmax of noisy logits), so a small MLP learns them and
  the loss clearly falls from ln(classes);
- ``data=tensors`` (:func:`tensor_files`): ``ROOT/train.pt`` and ``ROOT/eval.pt``, each a tuple
  ``(inputs, targets)`` saved with ``torch.save``, inputs ``(N, ..., features)``;
- ``data=lm_tokens`` (:func:`lm_tokens`): token walks through a fixed random successor table (each
  token may be followed by ``branching`` tokens), batches of the shape the paper's Tables 1 and 2
  need for the decoder-only Transformer-L; the loss falls from ln V towards ln(branching).

Training batches are a pure function of (seed, position), so a resumed run sees the batches an
uninterrupted one would have seen.

Example::

    from giantpipe.data.tensors import classification, lm_tokens

    bundle = classification(features=16, classes=8, train_size=4096, batch_size=64)
    inputs, targets = next(bundle.train_batches(seed=0, position=0))   # (64, 16), (64,)
    tokens, next_tokens = next(lm_tokens(vocab_size=1000, seq_len=64).train_batches(0, 0))

    torch.save((x_train, y_train), "mydata/train.pt")
    torch.save((x_eval, y_eval), "mydata/eval.pt")
    # python train.py recipe=mlp_quickstart data=tensors data.root=mydata data.features=784 \
    #     data.classes=10
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from giantpipe.config import ConfigError, check, check_choice, check_fits_memory, check_min
from giantpipe.data.bundle import Batch, DataBundle

# --------------------------------------------------------------------------- batch order


def epoch_order(size: int, seed: int, epoch: int) -> Tensor:
    """The shuffled sample order of one epoch: a function of (seed, epoch) only.

    Example::

        epoch_order(10, seed=0, epoch=3)   # the same permutation every time
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def shuffled_batches(
    inputs: Tensor, targets: Tensor, batch_size: int, seed: int, position: int
) -> Iterator[Batch]:
    """Endless shuffled batches (last partial batch of an epoch dropped), from batch ``position``.

    Batch ``p`` is batch ``p % per_epoch`` of epoch ``p // per_epoch``, so a resumed stream equals
    the uninterrupted one, and two consecutive batches of size B equal one batch of size 2B.

    Example::

        stream = shuffled_batches(x, y, batch_size=64, seed=0, position=10)
    """
    per_epoch = len(inputs) // batch_size
    while True:
        epoch, index = divmod(position, per_epoch)
        order = epoch_order(len(inputs), seed, epoch)
        while index < per_epoch:
            take = order[index * batch_size : (index + 1) * batch_size]
            yield inputs[take], targets[take]
            index += 1
            position += 1


def sequential_batches(inputs: Tensor, targets: Tensor, batch_size: int) -> list[Batch]:
    """The data in order, in batches of ``batch_size`` (the last one may be smaller)."""
    return [
        (inputs[i : i + batch_size], targets[i : i + batch_size])
        for i in range(0, len(inputs), batch_size)
    ]


# --------------------------------------------------------------------------- data=synthetic


def make_classification(
    size: int, features: int, classes: int, noise: float, seed: int, split: int = 0
) -> tuple[Tensor, Tensor]:
    """``size`` samples of split ``split`` (0 train, 1 eval) labelled by the teacher of ``seed``.

    Example::

        x, y = make_classification(100, features=4, classes=3, noise=0.1, seed=0, split=1)
    """
    teacher = torch.Generator().manual_seed(seed)
    hidden = torch.randn(features, features, generator=teacher) / features**0.5
    head = torch.randn(features, classes, generator=teacher)
    # Each split draws its inputs from its own stream: train and eval share the teacher only.
    samples = torch.Generator().manual_seed(seed * 1_000_003 + split + 1)
    x = torch.randn(size, features, generator=samples)
    logits = torch.tanh(x @ hidden) @ head + noise * torch.randn(size, classes, generator=samples)
    return x, logits.argmax(dim=1)


def classification(
    features: int = 16,
    classes: int = 8,
    train_size: int = 16384,
    eval_size: int = 512,
    batch_size: int = 64,
    noise: float = 0.1,
    seed: int = 1234,
) -> DataBundle:
    """A DataBundle of generated classification data (the ``data=synthetic`` option).

    Example::

        bundle = classification(batch_size=32)
        loss_name, metric = bundle.loss, bundle.metric   # "cross_entropy", "accuracy"
    """
    train_x, train_y = make_classification(train_size, features, classes, noise, seed)
    eval_x, eval_y = make_classification(eval_size, features, classes, noise, seed, split=1)
    eval_set = sequential_batches(eval_x, eval_y, batch_size)
    return DataBundle(
        train_batches=lambda order_seed, position: shuffled_batches(
            train_x, train_y, batch_size, order_seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=train_size // batch_size,
        loss="cross_entropy",
        metric="accuracy",
    )


@dataclass
class SyntheticDataConfig:
    """``data=synthetic``: the arguments of :func:`classification`, checked up front."""

    _target_: str = "giantpipe.data.tensors.classification"
    """Builder called with the other fields."""
    features: int = 16
    """Input width."""
    classes: int = 8
    """Number of classes."""
    train_size: int = 16384
    """Training samples."""
    eval_size: int = 512
    """Evaluation samples."""
    batch_size: int = 64
    """Mini-batch size N (the engine splits it into pipeline.chunks micro-batches)."""
    noise: float = 0.1
    """Standard deviation of the noise added to the teacher's logits (higher: harder)."""
    seed: int = 1234
    """Seed of the generated data set (the batch order follows trainer.seed)."""

    def __post_init__(self) -> None:
        for key in ("features", "classes", "train_size", "eval_size", "batch_size"):
            check_min(getattr(self, key), 1, f"data.{key}")
        check(self.classes >= 2, "data.classes", f"must be >= 2, got {self.classes}")
        check(
            self.batch_size <= self.train_size,
            "data.batch_size",
            f"must be <= data.train_size ({self.train_size}), got {self.batch_size}",
        )
        check_min(self.noise, 0.0, "data.noise")
        # Features (float32) and a label (int64) per sample, all drawn at start-up.
        check_fits_memory(
            (self.train_size + self.eval_size) * (4 * self.features + 8),
            "data.train_size, data.eval_size, data.features",
            "the generated data set",
        )


# --------------------------------------------------------------------------- data=tensors


def load_split(root: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Load ``root/split.pt`` as data only (``weights_only``: tensors and plain values, nothing
    that runs code); a missing, unreadable or unsafe file is a ConfigError naming ``data.root``
    and the file.

    Example::

        load_split(Path("mydata"), "train")
        # ConfigError: data.root: mydata/train.pt holds posix.system, which a data file of
        # tensors never needs; refused without running it (...)
    """
    path = root / f"{split}.pt"
    if not path.is_file():
        raise ConfigError("data.root", f"{path} not found (expected {split}.pt in {root})")
    try:
        loaded = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(err))
        if unsafe is None:
            raise ConfigError("data.root", f"{path} is not a readable torch file") from err
        raise ConfigError(
            "data.root",
            f"{path} holds {unsafe.group(1)}, which a data file of tensors never needs; refused "
            "without running it (load it yourself only if you trust where it came from, and "
            "save its tensors again: torch.save((inputs, targets), PATH))",
        ) from err
    except Exception as err:  # a truncated or foreign file: say which one, on one line
        reason = " ".join(str(err).split())[:200]
        raise ConfigError("data.root", f"{path} is not a readable torch file ({reason})") from err
    pair = isinstance(loaded, tuple | list) and len(loaded) == 2
    if not (pair and all(isinstance(t, Tensor) for t in loaded)):
        raise ConfigError("data.root", f"{path} must hold a tuple (inputs, targets) of two tensors")
    inputs, targets = loaded
    return inputs, targets


def tensor_files(
    root: str, features: int, classes: int, batch_size: int = 64, loss: str = "cross_entropy"
) -> DataBundle:
    """A DataBundle over ``root/train.pt`` and ``root/eval.pt`` (the ``data=tensors`` option).

    ``features`` (input width) is checked against the files; ``classes`` is the model's output
    width, which the model config reads from here.

    Example::

        bundle = tensor_files("mydata", features=784, classes=10, batch_size=32)
    """
    directory = Path(root).expanduser()
    if not directory.is_dir():
        raise ConfigError("data.root", f"directory not found: {directory}")
    train_x, train_y = load_split(directory, "train")
    eval_x, eval_y = load_split(directory, "eval")
    if train_x.shape[-1] != features:
        raise ConfigError("data.features", f"is {features}; the inputs have {train_x.shape[-1]}")
    if len(train_x) < batch_size:
        raise ConfigError("data.batch_size", f"{batch_size} exceeds the {len(train_x)} samples")
    eval_set = sequential_batches(eval_x, eval_y, batch_size)
    return DataBundle(
        train_batches=lambda seed, position: shuffled_batches(
            train_x, train_y, batch_size, seed, position
        ),
        eval_batches=lambda: eval_set,
        batches_per_epoch=len(train_x) // batch_size,
        loss=loss,
        metric="accuracy" if loss == "cross_entropy" else None,
        eval_set=str(directory / "eval.pt"),
    )


@dataclass
class TensorDataConfig:
    """``data=tensors``: the arguments of :func:`tensor_files`, checked up front."""

    _target_: str = "giantpipe.data.tensors.tensor_files"
    """Builder called with the other fields."""
    root: str = "???"
    """Directory holding train.pt and eval.pt, each a tuple (inputs, targets)."""
    features: int = "???"  # type: ignore[assignment]
    """Width of an input (last dimension); checked against the files; the model reads it."""
    classes: int = "???"  # type: ignore[assignment]
    """Output width: classes for cross_entropy, target width for mse; the model reads it."""
    batch_size: int = 64
    """Mini-batch size N."""
    loss: str = "cross_entropy"
    """``cross_entropy`` (integer targets) or ``mse``."""

    def __post_init__(self) -> None:
        for key in ("features", "classes", "batch_size"):
            check_min(getattr(self, key), 1, f"data.{key}")
        check_choice(self.loss, ("cross_entropy", "mse"), "data.loss")


# --------------------------------------------------------------------------- data=lm_tokens

HELD_OUT_INDEX = 1 << 20  # eval batches are drawn as if far past any training position


def successor_table(vocab_size: int, branching: int, seed: int) -> Tensor:
    """[vocab_size, branching] int64: the tokens allowed to follow each token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (vocab_size, branching), generator=generator)


def token_walks(table: Tensor, batch_size: int, length: int, generator: torch.Generator) -> Tensor:
    """[batch_size, length] token walks through ``table`` from uniformly drawn first tokens."""
    vocab_size, branching = table.shape
    tokens = torch.empty(batch_size, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    choices = torch.randint(0, branching, (batch_size, length), generator=generator)
    for t in range(1, length):
        tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]
    return tokens


def token_batch(
    table: Tensor, batch_size: int, seq_len: int, seed: int, index: int, held_out: bool = False
) -> Batch:
    """Batch number ``index`` of the stream ``seed``: (tokens, next tokens), [B, seq_len] each.

    A ``held_out`` batch starts one draw into its generator's stream. Generators take 32 bits
    of their seed, so every key ``seed * 1_000_003 + index`` is some training batch's key (with
    the data seed 1234, trainer.seed 1235 met held-out batch 0 as its training batch 48573);
    no training batch starts one draw in.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    if held_out:
        torch.randint(2, (1,), generator=generator)
    walk = token_walks(table, batch_size, seq_len + 1, generator)
    return walk[:, :-1].contiguous(), walk[:, 1:].contiguous()


def token_stream(
    table: Tensor, batch_size: int, seq_len: int, seed: int, position: int
) -> Iterator[Batch]:
    """Endless batches from ``position`` on; each depends only on (seed, its index)."""
    index = position
    while True:
        yield token_batch(table, batch_size, seq_len, seed, index)
        index += 1


class WalkSamples:
    """``evaluate_model`` of ``data=lm_tokens`` with ``eval_samples`` > 0: the model continues a
    fixed list of prompts (the first ``PROMPT_TOKENS`` of held-out walks) greedily, through the
    pipe's stages with their key/value caches (:mod:`giantpipe.engine.generate`). Returns the
    samples as text (``samples``: logged, in the summary) and ``sample_valid``, the share of
    generated steps the successor table allows (1.0: the model learnt the walks; about
    branching / vocab_size untrained).

    Example::

        hook = WalkSamples(table, prompts=held_out[0][0][:3, :8], length=16)
        hook(pipe)     # {"samples": "12 7 ... -> 40 3 ...", "sample_valid": 0.97}
    """

    takes_pipe = True  # the runner hands it the pipe, on every rank
    config_key = "data.eval_samples"  # what asked for it, if the model cannot generate

    def __init__(self, table: Tensor, prompts: Tensor, length: int) -> None:
        self.table, self.prompts, self.length = table, prompts, length

    def __call__(self, pipe: nn.Module) -> dict[str, float | str]:
        from giantpipe.engine.generate import Decoding, generate

        out = generate(pipe, [self.prompts], [self.length], Decoding())[0]
        lines, allowed, steps = [], 0, 0
        for prompt, tokens in zip(self.prompts.tolist(), out, strict=True):
            walk = prompt[-1:] + tokens
            for a, b in zip(walk, walk[1:], strict=False):
                allowed += int(b in self.table[a].tolist())
                steps += 1
            lines.append(" ".join(map(str, prompt)) + " -> " + " ".join(map(str, tokens)))
        return {"samples": " | ".join(lines), "sample_valid": allowed / max(steps, 1)}


PROMPT_TOKENS, SAMPLE_TOKENS = 8, 24


def lm_tokens(
    vocab_size: int = 32000,
    seq_len: int = 1024,
    batch_size: int = 32,
    batches_per_epoch: int = 1000,
    eval_batches: int = 2,
    branching: int = 4,
    seed: int = 1234,
    eval_samples: int = 0,
) -> DataBundle:
    """Generated language-model batches (fields: ``LMTokensDataConfig``).

    Example::

        bundle = lm_tokens(vocab_size=1000, seq_len=64, batch_size=8)
        bundle.tokens_per_batch(next(bundle.train_batches(0, 0)))      # 512
    """
    table = successor_table(vocab_size, branching, seed)
    held_out = [
        token_batch(table, batch_size, seq_len, seed, HELD_OUT_INDEX + i, held_out=True)
        for i in range(eval_batches)
    ]
    samples = None
    if eval_samples > 0:
        first = held_out[0][0]
        assert isinstance(first, Tensor)
        size = min(PROMPT_TOKENS, seq_len // 2)  # prompt and sample within seq_len positions
        length = min(SAMPLE_TOKENS, seq_len - size)
        samples = WalkSamples(table, first[:eval_samples, :size], length)
    return DataBundle(
        train_batches=lambda run_seed, position: token_stream(
            table, batch_size, seq_len, run_seed, position
        ),
        eval_batches=lambda: held_out,
        batches_per_epoch=batches_per_epoch,
        loss="cross_entropy",
        metric="accuracy",
        tokens_per_batch=lambda batch: batch[1].numel(),  # type: ignore[union-attr]
        evaluate_model=samples,
    )


@dataclass
class LMTokensDataConfig:
    """``data=lm_tokens``: the arguments of :func:`lm_tokens`, checked up front."""

    _target_: str = "giantpipe.data.tensors.lm_tokens"
    """Builder called with the other fields."""
    vocab_size: int = 32000
    """Token ids are drawn below this."""
    seq_len: int = 1024
    """Tokens per sequence (the paper's Transformer-L uses 1024)."""
    batch_size: int = 32
    """Sequences per mini-batch N."""
    batches_per_epoch: int = 1000
    """Nominal epoch length (the stream is endless)."""
    eval_batches: int = 2
    """Held-out batches for the eval loss."""
    branching: int = 4
    """Each token has this many possible successors, so the loss can fall to ln(branching)."""
    seed: int = 1234
    """Seed of the successor table and the held-out batches."""
    eval_samples: int = 0
    """At every evaluation, continue this many fixed prompts (held-out walks' first 8 tokens)
    by 24 tokens, cached greedy decoding through the pipe: logged as ``samples``, with
    ``sample_valid`` (share of generated steps the successor table allows). 0: none; at most
    data.batch_size."""

    def __post_init__(self) -> None:
        check_min(self.eval_samples, 0, "data.eval_samples")
        check(
            self.eval_samples <= self.batch_size,
            "data.eval_samples",
            f"must be <= data.batch_size ({self.batch_size}), got {self.eval_samples}",
        )
        for key in ("vocab_size", "batches_per_epoch", "eval_batches", "branching"):
            check_min(getattr(self, key), 1, f"data.{key}")
        check_min(self.seq_len, 2, "data.seq_len")
        check_min(self.batch_size, 1, "data.batch_size")
        check(
            self.branching <= self.vocab_size,
            "data.branching",
            f"must be <= data.vocab_size ({self.vocab_size}), got {self.branching}",
        )
        # The successor table, and one batch of int64 tokens (inputs and shifted targets).
        check_fits_memory(
            8 * self.vocab_size * self.branching,
            "data.vocab_size, data.branching",
            "the successor table",
        )
        check_fits_memory(
            16 * self.batch_size * self.seq_len, "data.batch_size, data.seq_len", "one batch"
        )
