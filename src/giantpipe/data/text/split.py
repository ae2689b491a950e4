"""The held-out split of ``data=text``: ``data.valid_fraction`` of the documents, drawn by
``data.seed``, so no held-out sentence is ever trained on.

Example::

    from giantpipe.data.text.split import held_out

    held_out(10, 0.2, seed=0)    # two indices, always the same two
"""

from __future__ import annotations

from giantpipe.config import ConfigError
from giantpipe.data.batch_order import epoch_order


def held_out(count: int, fraction: float, seed: int) -> set[int]:
    """Indices of the held-out documents: ``fraction`` of ``count`` (at least one, at most all
    but one), drawn by ``seed``; the same every time.

    Example::

        held_out(10, 0.2, seed=0)    # two indices, always the same two
    """
    if count < 2:
        raise ConfigError(
            "data.files",
            f"{count} document(s); a held-out split needs at least 2 (with data.txt_documents="
            "paragraph, separate documents with a blank line)",
        )
    size = min(count - 1, max(1, round(fraction * count)))
    return set(epoch_order(count, seed, epoch=0)[:size].tolist())
