"""Prompts of unequal length in one micro-batch: left-padded, with the mask of each row's tokens.

Rows of unequal length, or a tensor left-padded with ``pad_id``, reach stage 0 as
``(tokens, keep)``, so each row decodes as that prompt alone
(docs/generation.md#inside-the-ring-and-its-messages).

Example::

    >>> tokens, keep = padded_prompt([[5, 6, 7], [8, 9]], pad_id=0)
    >>> tokens.tolist(), keep.int().tolist()
    ([[5, 6, 7], [0, 8, 9]], [[1, 1, 1], [0, 1, 1]])
    >>> prompt_input(torch.tensor([[0, 0, 4], [1, 2, 3]]), pad_id=0, m=0)[1].int().tolist()
    [[0, 0, 1], [1, 1, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from giantpipe.engine.generate.decoding import Value

__all__ = ["padded_prompt", "prompt_input"]


def _row(row: Any, m: int, r: int) -> list[int]:
    """Row ``r`` of micro-batch ``m`` as token ids; a ValueError names what is wrong."""
    where = f"prompt row {r} of micro-batch {m}"
    if isinstance(row, Tensor):
        if row.dim() != 1 or row.dtype.is_floating_point or row.dtype == torch.bool:
            raise ValueError(f"{where} is a tensor of shape {tuple(row.shape)} and dtype "
                             f"{row.dtype}; give a 1-D tensor of token ids")  # fmt: skip
        row = row.tolist()
    if not isinstance(row, Sequence) or isinstance(row, str):
        raise ValueError(f"{where} is a {type(row).__name__}; give a list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
        bad = next(t for t in row if not isinstance(t, int) or isinstance(t, bool))
        raise ValueError(f"{where} holds {bad!r}; token ids are ints")
    if not row:
        raise ValueError(f"{where} is empty; a prompt needs at least one token")
    return list(row)


def padded_prompt(rows: Sequence[Any], pad_id: int | None = None, m: int = 0) -> Value:
    """``rows`` (lists of token ids or 1-D tensors) as stage 0's input: the plain tensor when
    they have one length, else ``(tokens, keep)`` left-padded with ``pad_id`` (0 when None: the
    mask hides it). ``m`` names the micro-batch in errors.

    >>> padded_prompt([[1, 2], [3, 4]]).tolist()
    [[1, 2], [3, 4]]
    """
    if not rows:
        raise ValueError(f"micro-batch {m} of prompts has no rows")
    ids = [_row(row, m, r) for r, row in enumerate(rows)]
    width = max(map(len, ids))
    if all(len(row) == width for row in ids):
        return torch.tensor(ids, dtype=torch.long)
    fill = 0 if pad_id is None else pad_id
    tokens = torch.tensor([[fill] * (width - len(row)) + row for row in ids], dtype=torch.long)
    lengths = torch.tensor([len(row) for row in ids])
    keep = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    return tokens, keep


def _padded_tensor(tokens: Tensor, pad_id: int, m: int) -> Value:
    """A token tensor whose rows may begin with ``pad_id``: those leading tokens are padding."""
    keep = (tokens != pad_id).long().cummax(dim=1).values.bool()  # from the first token on
    for r in range(tokens.shape[0]):
        if not bool(keep[r].any()):
            raise ValueError(f"prompt row {r} of micro-batch {m} is all padding (pad_id={pad_id})")
        if int(tokens[r, -1]) == pad_id:
            raise ValueError(
                f"prompt row {r} of micro-batch {m} ends with pad_id={pad_id}: pad prompts on "
                "the left, or give the rows as a list of token-id lists (generate pads them)"
            )
    return tokens if bool(keep.all()) else (tokens, keep)


def prompt_input(prompt: Value, pad_id: int | None, m: int) -> Value:
    """Micro-batch ``m`` of prompts as stage 0 takes it: a list of rows padded, a token
    tensor's leading ``pad_id`` tokens masked, anything else as it is
    (docs/generation.md#inside-the-ring-and-its-messages)."""
    if isinstance(prompt, list):
        return padded_prompt(prompt, pad_id, m)
    if isinstance(prompt, Tensor) and prompt.dim() == 2 and pad_id is not None:
        if not prompt.dtype.is_floating_point and prompt.dtype != torch.bool:
            return _padded_tensor(prompt, pad_id, m)
    return prompt
