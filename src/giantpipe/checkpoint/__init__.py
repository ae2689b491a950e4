"""Checkpoints: one format for both executors, on ``torch.distributed.checkpoint`` (DCP), by the
plain model's names, committed by a manifest holding every file's hash; saved, loaded and
exported by share. The layout on disk and why: docs/checkpoints.md.

- :mod:`.errors`: a file that cannot be read as asked, named in one line;
- :mod:`.files`, :mod:`.names`: files written whole or not at all; the names giantpipe writes;
- :mod:`.manifest`: the commit record that names one save, read back checked;
- :mod:`.storage`: DCP's files, hashed as written, read with an allow-list;
- :mod:`.save`, :mod:`.load`: one collective save; tensors by name, only what a rank needs;
- :mod:`.sources`, :mod:`.run`: tensors by name from one source; a run's checkpoint read back;
- :mod:`.safetensors_files`, :mod:`.weights`: safetensors by name, in shards; a run's start;
- :mod:`.earlier`: the earlier formats and renamed keys, read until a stated release;
- :mod:`.unpickling`: ``torch.load`` with ``weights_only`` and a short allow-list;
- :mod:`.cleanup`: what interrupted saves left, and only that, removed;
- :mod:`.export`: the weights exported tensor by tensor (a file, shards, a HF folder).
"""
