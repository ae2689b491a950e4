"""Checkpoints of a pipeline on ``torch.distributed.checkpoint`` (DCP), by un-partitioned names,
committed by a manifest that holds a content hash of every file.

::

    ckpt/
      manifest.json                  the commit point: layout, balance, names per rank, and the
                                     size and sha256 of every file below (and of itself)
      step000000100-3f9c2a/          one save, in DCP's format
        .metadata                    DCP's index: name -> file, offset, shape, dtype
        __0_0.distcp                 rank 0's tensors: "0.weight", "1.bias", ...
        __1_0.distcp                 rank 1's: "4.weight", ...

Names are those of the plain model, so a run resumes under another K, V or R (each rank reads
its names from whichever files hold them: DCP reshards by name) and :func:`consolidate`
(``python -m giantpipe.consolidate ckpt/ model.pt``) merges them into one state dict the plain
model loads. A save writes a new folder under a name unique to it, fsyncs every file, then
replaces ``manifest.json`` (``os.replace``): a process killed at any moment leaves the previous
manifest and the folder it names whole. The previous folder is removed only after the new
manifest is in place, and only what giantpipe's own names prove it wrote (:func:`stale`);
nothing at all when the previous manifest could not be read.

Loading checks before it reads: the manifest's own hash, then the size and sha256 of each
file it will open (a flipped byte or a truncated file is :class:`CheckpointDamaged`, naming the
file), and DCP's ``.metadata`` is unpickled with an allow-list of DCP's own classes; tensors
load with ``weights_only``: a checkpoint never runs code. Checkpoints of the earlier format
(``giantpipe-shards/1``: one ``step...-rankNNNNN.pt`` per rank beside the manifest) still load.

Example::

    pipe.save_checkpoint("ckpt", step=100)                 # all ranks
    state = load("ckpt", pipe.state_dict().keys())         # any layout
    consolidate("ckpt", "model.pt")                        # one process, no torch.distributed

Its parts, one concept each:

- :mod:`.files`: files written whole or not at all, fsync, content hashes;
- :mod:`.record`: the commit record (the manifest), read back checked, files checked against it;
- :mod:`.cleanup`: what earlier saves left, under giantpipe's own names, and may be removed;
- :mod:`.saving`: one save, collective (DCP's files hashed as written), then the commit;
- :mod:`.reading`: reading a save, only the files a rank needs, nothing unpickled but DCP's;
- :mod:`.consolidation`: one file for the plain model.

This package re-exports the names its users call as ``shards.X`` (the runner's checkpoints,
``giantpipe.consolidate``, ``DistributedPipe``), so that they need not know which part holds
what; code that replaces one (a test's monkeypatch) patches the part that calls it.
"""

from __future__ import annotations

import warnings

from giantpipe.engine.distributed.shards.cleanup import stale
from giantpipe.engine.distributed.shards.consolidation import consolidate, merged, summary
from giantpipe.engine.distributed.shards.files import (
    FILE_MODE,
    atomic_save,
    describe,
    file_digest,
    new_token,
)
from giantpipe.engine.distributed.shards.reading import load, read_metadata, tensor_names
from giantpipe.engine.distributed.shards.record import (
    FORMAT,
    MANIFEST,
    OLD_FORMAT,
    CheckpointDamaged,
    committed_files,
    read_manifest,
    record_hash,
    verify,
    weight_names,
)
from giantpipe.engine.distributed.shards.saving import (
    commit,
    layout_meta,
    replica_share,
    save,
    save_collective,
    write_folder,
)

__all__ = [
    "FILE_MODE",
    "FORMAT",
    "MANIFEST",
    "OLD_FORMAT",
    "CheckpointDamaged",
    "atomic_save",
    "commit",
    "committed_files",
    "consolidate",
    "describe",
    "file_digest",
    "layout_meta",
    "load",
    "merged",
    "new_token",
    "read_manifest",
    "read_metadata",
    "record_hash",
    "replica_share",
    "save",
    "save_collective",
    "stale",
    "summary",
    "tensor_names",
    "verify",
    "weight_names",
    "write_folder",
]

# DCP says so at every call without a process group; that is how one process saves and loads.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable")
