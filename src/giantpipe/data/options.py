"""The ``data=`` options' schemas: one dataclass per option, its fields the builder's arguments,
checked in ``__post_init__``; this module imports no torch.

The command line imports it to check a data option before torch is imported, then calls the
builder its ``_target_`` names (``SyntheticDataConfig``: :mod:`giantpipe.data.synthetic`, ...,
``TranslationDataConfig``: :mod:`giantpipe.data.translation.bundle`). It imports the standard
library and ``giantpipe.config`` only; a check that needs more stays with its builder.

Example::

    from giantpipe.data.options import SyntheticDataConfig

    SyntheticDataConfig(classes=1)    # ConfigError: data.classes: must be >= 2, got 1
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from giantpipe.config import check, check_choice, check_fits_memory, check_min, check_optional_path

MOVED_TARGETS = {
    "giantpipe.data.tensors.classification": "giantpipe.data.synthetic.classification",
    "giantpipe.data.tensors.tensor_files": "giantpipe.data.tensor_files.tensor_files",
    "giantpipe.data.tensors.lm_tokens": "giantpipe.data.lm_tokens.lm_tokens",
    "giantpipe.data.image_bundle.generated_images": "giantpipe.data.images.bundle.generated_images",
    "giantpipe.data.image_bundle.random_images": "giantpipe.data.images.bundle.random_images",
    "giantpipe.data.image_bundle.image_folder": "giantpipe.data.images.bundle.image_folder",
    "giantpipe.data.text.text": "giantpipe.data.text.bundle.text",
    "giantpipe.data.translation_bundle.translation": (
        "giantpipe.data.translation.bundle.translation"
    ),
}
"""Old ``_target_`` -> where the builder lives now (issue 31 moved them): a run saved before the
move names the old one in its config.yaml, and resumes, or is rebuilt from it, unchanged."""

DOCUMENTS = ("paragraph", "file", "line")
"""What one document of a ``.txt`` file can be (``data.txt_documents``)."""


@dataclass
class SyntheticDataConfig:
    """``data=synthetic``: the arguments of :func:`classification`, checked up front."""

    _target_: str = "giantpipe.data.synthetic.classification"
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


@dataclass
class TensorDataConfig:
    """``data=tensors``: the arguments of :func:`tensor_files`, checked up front."""

    _target_: str = "giantpipe.data.tensor_files.tensor_files"
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


@dataclass
class LMTokensDataConfig:
    """``data=lm_tokens``: the arguments of :func:`lm_tokens`, checked up front."""

    _target_: str = "giantpipe.data.lm_tokens.lm_tokens"
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


def _check_image_batches(image_size: int, batch_size: int, num_classes: int) -> None:
    check_min(image_size, 8, "data.image_size")
    check_min(batch_size, 1, "data.batch_size")
    check_min(num_classes, 2, "data.num_classes")


@dataclass
class GeneratedImagesDataConfig:
    """``data=images_generated``: the arguments of :func:`generated_images`, checked up front."""

    _target_: str = "giantpipe.data.images.bundle.generated_images"
    """Builder called with the other fields."""
    image_size: int = 32
    """Height and width in pixels."""
    num_classes: int = 10
    """Classes (each a pattern family, orientation and colour pair)."""
    train_size: int = 4096
    """Training images (rendered once at start-up, about 1 ms each at 32 px)."""
    eval_size: int = 512
    """Held-out images (rendered from seed + 1, so never training images)."""
    batch_size: int = 64
    """Mini-batch size N."""
    noise: float = 0.08
    """Pixel noise (higher: harder)."""
    seed: int = 0
    """Seed of the images (the batch order follows trainer.seed)."""

    def __post_init__(self) -> None:
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        check(
            self.batch_size <= self.train_size,
            "data.batch_size",
            f"must be <= data.train_size ({self.train_size}), got {self.batch_size}",
        )
        check_min(self.eval_size, 1, "data.eval_size")
        check_min(self.noise, 0.0, "data.noise")
        # Every image is rendered once into memory at start-up (float32, 3 channels).
        check_fits_memory(
            (self.train_size + self.eval_size) * (12 * self.image_size**2 + 8),
            "data.train_size, data.eval_size, data.image_size",
            "the rendered images",
        )


@dataclass
class RandomImagesDataConfig:
    """``data=images_random``: the arguments of :func:`random_images`, checked up front."""

    _target_: str = "giantpipe.data.images.bundle.random_images"
    """Builder called with the other fields."""
    image_size: int = 224
    """Height and width in pixels."""
    num_classes: int = 1000
    """Label range."""
    batch_size: int = 128
    """Mini-batch size N."""
    epoch_size: int = 1281167
    """Images per "epoch" (ImageNet's), so epoch-valued schedules mean what they would there."""
    seed: int = 0
    """Seed of the pixels and labels."""

    def __post_init__(self) -> None:
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        check_fits_memory(
            12 * self.batch_size * self.image_size**2,
            "data.batch_size, data.image_size",
            "the one batch of random images",
        )
        check(
            self.epoch_size >= self.batch_size,
            "data.epoch_size",
            f"must be >= data.batch_size ({self.batch_size}), got {self.epoch_size}",
        )


@dataclass
class ImageFolderDataConfig:
    """``data=images_folder``: the arguments of :func:`image_folder`, checked up front."""

    _target_: str = "giantpipe.data.images.bundle.image_folder"
    """Builder called with the other fields."""
    root: str = "data/imagenet"
    """Directory with train/<class>/* and val/<class>/* (or parquet / arrow files whose paths say
    train and val, with source=hf)."""
    num_classes: int = 1000
    """Class folders expected (checked against the data; the model reads it)."""
    image_size: int = 224
    """Training crop and evaluation crop size in pixels."""
    batch_size: int = 256
    """Mini-batch size N."""
    eval_batch_size: int | None = None
    """Evaluation batch size (null: data.batch_size)."""
    source: str = "imagefolder"
    """``imagefolder`` (torchvision) or ``hf`` (HuggingFace datasets: folders, parquet, arrow)."""
    min_scale: float = 0.08
    """Smallest area fraction of a random-resized training crop."""
    hflip: bool = True
    """Random horizontal flips in training."""
    cutout: int = 0
    """Side of the Cutout square in pixels (0: none)."""
    num_workers: int = 8
    """Loader worker processes (0: load in the training process)."""
    cache_dir: str | None = None
    """HuggingFace datasets cache (source=hf)."""
    skip_bad_files: bool = False
    """Skip unreadable images (not an image, truncated), listing each in the log with the count;
    false: the first one stops the run, naming the file."""

    def __post_init__(self) -> None:
        check(bool(self.root), "data.root", "must name a directory")
        _check_image_batches(self.image_size, self.batch_size, self.num_classes)
        if self.eval_batch_size is not None:
            check_min(self.eval_batch_size, 1, "data.eval_batch_size")
        check_choice(self.source, ("imagefolder", "hf"), "data.source")
        check(
            0.0 < self.min_scale <= 1.0,
            "data.min_scale",
            f"must be in (0, 1], got {self.min_scale}",
        )
        check_min(self.cutout, 0, "data.cutout")
        check_min(self.num_workers, 0, "data.num_workers")
        check_optional_path(self.cache_dir, "data.cache_dir")


@dataclass
class TextDataConfig:
    """``data=text``: the arguments of :func:`text`, checked up front."""

    _target_: str = "giantpipe.data.text.bundle.text"
    """Builder called with the other fields."""
    files: list[str] = field(default_factory=list)
    """Globs of .txt / .jsonl / .parquet files, or folders saved by datasets' save_to_disk."""
    seq_len: int = 128
    """Tokens per sequence."""
    batch_size: int = 16
    """Sequences per mini-batch N."""
    vocab_size: int = 2000
    """Ids the model outputs: the SentencePiece size to train, or >= the given tokenizer's."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory or a SentencePiece .model; null: train SentencePiece."""
    text_field: str = "text"
    """The field (.jsonl) or column (.parquet, saved datasets) holding the text."""
    txt_documents: str = "paragraph"
    """What one document of a .txt file is: ``paragraph`` (blank-line separated), ``file``,
    ``line``."""
    valid_fraction: float = 0.1
    """Share of the documents held out for evaluation (at least one document)."""
    eval_batches: int | None = None
    """Held-out batches per evaluation; null: all of them."""
    cache_dir: str | None = None
    """Where the trained tokenizer is kept; null: .giantpipe_cache beside the first file."""
    seed: int = 1234
    """Seed of the held-out split and of the tokenizer's training (batch order: trainer.seed)."""

    def __post_init__(self) -> None:
        check_min(self.seq_len, 2, "data.seq_len")
        check_min(self.batch_size, 1, "data.batch_size")
        check_min(self.vocab_size, 8, "data.vocab_size")
        check_choice(self.txt_documents, DOCUMENTS, "data.txt_documents")
        check(
            0.0 < self.valid_fraction < 1.0,
            "data.valid_fraction",
            f"must be between 0 and 1, got {self.valid_fraction}",
        )
        if self.eval_batches is not None:
            check_min(self.eval_batches, 1, "data.eval_batches")
        check(bool(re.fullmatch(r"\S+", self.text_field)), "data.text_field", "must name a field")


@dataclass
class TranslationDataConfig:
    """``data=translation``: the arguments of :func:`translation`, checked up front."""

    _target_: str = "giantpipe.data.translation.bundle.translation"
    """Builder called with the other fields (and the run directory)."""
    train_files: list[str] | None = None
    """TSV (header row), JSONL or parquet files of (source, target, pair) rows; null: write the
    generated multilingual corpus into the run directory and train on it."""
    valid_files: list[str] | None = None
    """Held-out files for the eval loss and BLEU (needed with train_files)."""
    source_field: str = "source"
    """Column of the source sentence."""
    target_field: str = "target"
    """Column of the target sentence."""
    pair_field: str = "pair"
    """Column naming the language pair, e.g. ``en-de``."""
    vocab_size: int = 8000
    """Shared SentencePiece vocabulary size (an upper bound; the model's output size)."""
    vocab_dir: str | None = None
    """Where spm.model is trained or reused; null: the run directory (reused on resume)."""
    max_len: int = 128
    """Longest sentence in tokens, with markers (the model's positions): longer training pairs
    are left out, longer held-out ones left out of the eval loss and cut for BLEU (all counted
    in the log)."""
    max_tokens: int = 4096
    """Batch size in tokens: sentences x padded length <= max_tokens."""
    min_sentences: int = 1
    """Fewest sentences in a batch (the recipes set it to pipeline.chunks)."""
    temperature: float = 5.0
    """Sampling temperature over language pairs: p ~ (n_pair / N)^(1/T)."""
    zero_shot: bool = False
    """Evaluate held-out pairs no training file holds (zero-shot), as eval/bleu_zero_shot apart
    from eval/bleu; false: such a pair is an error naming it."""
    generated_languages: int = 3
    """Generated corpus: languages besides English (pairs en-xx and xx-en)."""
    generated_train_sizes: list[int] | None = None
    """Generated corpus: training sentences per language (null: 8000, 2000, 500, ...)."""
    generated_eval_size: int = 100
    """Generated corpus: held-out sentences per direction."""
    generated_seed: int = 0
    """Generated corpus: seed of the languages and sentences."""
    bleu_sentences: int | None = 100
    """Held-out sentences per pair decoded for BLEU at each evaluation (null: all; 0: none)."""
    beam_size: int = 1
    """1: greedy decoding; more: beam search with a GNMT length penalty."""
    length_penalty: float = 0.6
    """Beam search length penalty alpha."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "max_len", "max_tokens", "min_sentences", "beam_size"):
            check_min(getattr(self, key), 1, f"data.{key}")
        check(self.temperature > 0, "data.temperature", f"must be > 0, got {self.temperature}")
        check_min(self.generated_languages, 1, "data.generated_languages")
        check_min(self.generated_eval_size, 1, "data.generated_eval_size")
        for size in self.generated_train_sizes or ():
            check_min(size, 1, "data.generated_train_sizes")
        # Generated sentence pairs are held as int64 tokens of up to max_len per side.
        pairs = sum(self.generated_train_sizes or ()) + self.generated_eval_size * (
            2 * self.generated_languages
        )
        check_fits_memory(
            pairs * 16 * self.max_len,
            "data.generated_train_sizes, data.generated_eval_size, data.max_len",
            "the generated corpus",
        )
        if self.bleu_sentences is not None:
            check_min(self.bleu_sentences, 0, "data.bleu_sentences")
        check(
            self.max_tokens >= self.min_sentences * 4,
            "data.max_tokens",
            f"{self.max_tokens} leaves no room for {self.min_sentences} sentences per batch",
        )
