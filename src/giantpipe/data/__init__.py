"""Data: the ``data=`` options, each a builder returning a ``DataBundle`` (the runner's contract,
in ``bundle``) with its schema dataclass beside it.

- ``tensors``: data held as tensors: generated classification (``data=synthetic``), your own
  ``train.pt`` / ``eval.pt`` (``data=tensors``), generated LM tokens (``data=lm_tokens``);
- ``images`` (data sets, transforms, loaders) and ``image_bundle`` (``data=images_generated``,
  ``images_random``, ``images_folder``);
- ``corpus`` (parallel corpora as files: yours read with errors naming the file and line, the
  generated multilingual one written), ``translation`` (shared vocabulary, token batches),
  ``bleu`` (decoding and BLEU) and ``translation_bundle`` (``data=translation``);
- ``text``: your own text files as packed language-model batches (``data=text``).

Imported by the runner (``bundle``) and, through a config's ``_target_``, by the entry point.
Imports ``giantpipe.config`` and nothing else of giantpipe: never the engine, the runner or
``models/`` (decoding reaches a model through the methods the model object offers). Import from
the submodules; this package stays empty so each pipeline loads only what it needs.
"""
