"""Checkpoints: one format for both executors, on ``torch.distributed.checkpoint`` (DCP), by
un-partitioned names, committed by a manifest holding every file's hash.

A checkpoint is a directory (``RUN/last/``, ``RUN/step_N/``) in the format of
:mod:`giantpipe.engine.distributed.shards`, with the run's state beside the weights::

    last/
      manifest.json                    the commit point: layout, step, data position, the model's
                                       builder, and the size and sha256 of every file below
      step000000100-3f9c2a/            one save (DCP's format)
        .metadata                      DCP's index of the tensors
        __0_0.distcp                   rank 0's tensors: weights ("0.weight"), the optimizer's
                                       ("optimizer/0.weight/exp_avg"), the EMA's ("ema/0.weight")
        __1_0.distcp                   (torchrun: one per rank; a local run writes one)
        state-rank00000.pt             rank 0's run state: LR schedule, fp16's loss scale, RNG,
        state-rank00001.pt             the optimizer's other values and parameter groups

Every file is fsynced under a new folder before the manifest, written last, makes the save
count: a crash at any moment leaves the previous checkpoint whole. Loading checks each file it
reads against the manifest's hash first (a flipped byte or a truncated file is one line naming
it, and the kept ``step_N/`` to resume from instead). Optimizer and EMA state are keyed by
parameter NAME, so a run resumes under another K, R or executor (a torchrun run resumes in one
process and back): every rank reads its names from whichever files hold them. RNG states come
from the same rank where it existed (the generators themselves: :mod:`giantpipe.runner.seeding`).
``trainer.async_save`` copies the state to host memory in the step and writes it in a
background thread (:class:`~giantpipe.runner.checkpoint.writer.CheckpointWriter`).
``python -m giantpipe.consolidate RUN/last model.pt`` merges the weights for the plain model.

Checkpoints of the earlier formats still load for ``trainer.resume`` (and ``trainer.init_from``):
shards and run state as ``.pt`` files beside the manifest (``giantpipe-shards/1``), and one
``.pt`` holding everything (``last.pt``).

    state.py       a run's state by name: Progress, the format's names, optimizer state by name
    saving.py      one save: staged state, written in DCP's format and committed; the model record
    writer.py      CheckpointWriter: saves in the step or in a background thread
    reading.py     a checkpoint's manifest, hash-checked files, read_checkpoint, damage refused
    restore.py     resume: a checkpoint into the built parts, under any K, R or executor
    legacy.py      the earlier format: one ``.pt`` file holding everything
    unpickling.py  safe loading: ``torch.load`` with ``weights_only`` and its allow-list
    init_from.py   fine-tuning: the matching weights of another run (``trainer.init_from``)

``read_checkpoint`` is importable from here too (``giantpipe.runner.checkpoint.read_checkpoint``,
as docs/running.md names it for looking into a checkpoint).

Example::

    save_run(parts, progress, run_dir / "last", world)      # saving; every rank
    progress = restore(parts, run_dir / "last", world)      # restore; any K, R or executor
    read_checkpoint(run_dir / "last")["step"]               # 100
"""

from __future__ import annotations

from giantpipe.runner.checkpoint.reading import read_checkpoint

__all__ = ["read_checkpoint"]
