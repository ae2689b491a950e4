"""Packing text for a language model: the documents' tokens, each document ended by the
end-of-text token, concatenated and cut into rows of ``seq_len`` + 1 tokens; and the unigram
perplexity a model must beat.

Example::

    from giantpipe.data.text.packing import pack, unigram_perplexity

    rows = pack(["a b c", "d e"], vocab, seq_len=4)   # inputs rows[:, :-1], targets rows[:, 1:]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from giantpipe.data.text.vocabulary import Vocabulary


def pack(texts: Sequence[str], vocab: Vocabulary, seq_len: int) -> Tensor:
    """[N, seq_len + 1] int64: the documents' ids, each followed by end-of-text, concatenated and
    cut into rows that overlap by one token (row i's last token starts row i + 1), so every
    token but the first is a target exactly once. The tail shorter than a row is left out.

    Example::

        rows = pack(["a b c", "d e"], vocab, seq_len=4)   # inputs rows[:, :-1], targets rows[:, 1:]
    """
    # One tensor per document (a Python list of every id would take ~10x the memory).
    parts = [torch.tensor([*vocab.encode(doc), vocab.eos_id], dtype=torch.long) for doc in texts]
    stream = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    rows = (len(stream) - 1) // seq_len
    if rows < 1:
        return torch.empty(0, seq_len + 1, dtype=torch.long)
    starts = torch.arange(rows) * seq_len
    return stream[starts.unsqueeze(1) + torch.arange(seq_len + 1)]


def unigram_perplexity(train: Tensor, held: Tensor, vocab_size: int) -> float:
    """The held-out perplexity of the training set's token frequencies (add-one smoothed): what
    a model that ignores context scores, the baseline a language model must beat.

    Example::

        unigram_perplexity(train_rows[:, 1:], valid_rows[:, 1:], vocab.size)   # e.g. 41.7
    """
    counts = torch.bincount(train.flatten(), minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return math.exp(-log_p[held.flatten()].mean().item())
