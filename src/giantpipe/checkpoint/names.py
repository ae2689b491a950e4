"""The names giantpipe gives what it writes in a checkpoint directory; only what bears one of
them is ever removed (:mod:`giantpipe.checkpoint.cleanup`).

>>> bool(SAVE_FOLDER.fullmatch(new_token(100))), state_file(3)
(True, 'state-rank00003.pt')
"""

from __future__ import annotations

import re
import secrets

MANIFEST = "manifest.json"
"""The commit record of a checkpoint directory (:mod:`giantpipe.checkpoint.manifest`)."""
SAVE_FOLDER = re.compile(r"step\d{9}-[0-9a-f]{6}")
"""The folder of one save (:func:`new_token`)."""
IN_FOLDER = re.compile(r"\.metadata(\.tmp)?|__\d+_\d+\.distcp|state-rank\d{5}\.pt|\..+\.tmp")
"""What a save's folder holds: DCP's files, each rank's run state, temporary names."""
MANIFEST_TMP = re.compile(r"\.manifest\.json\..+\.tmp")
"""A manifest being written (:func:`giantpipe.checkpoint.files.atomic_write_text`)."""
REMOVING = re.compile(r"\..+\.removing-[0-9a-f]{6}")
"""A checkpoint directory set aside to be removed (``cleanup.remove_checkpoint``)."""


def new_token(step: int) -> str:
    """A name unique to one save: ``step000000100-3f9c2a`` (every rank must use the same)."""
    return f"step{step:09d}-{secrets.token_hex(3)}"


def state_file(rank: int) -> str:
    """A rank's run-state file in a save's folder."""
    return f"state-rank{rank:05d}.pt"


OPTIMIZER, EMA = "optimizer/", "ema/"
"""Prefixes of the optimizer's and the EMA's tensors beside the weights in a run's checkpoint:
``optimizer/0.weight/exp_avg``, ``ema/0.weight``."""
