"""Data: the ``data=`` options, each a builder returning a ``DataBundle`` (the runner's contract),
their schemas in one torch-free module.

- ``bundle``: the contract between a builder and the runner (:class:`DataBundle`);
- ``options``: every option's schema dataclass, checked up front, importing no torch;
- ``batch_order``: the seeded batch order the in-memory options share (resumable by position);
- ``synthetic``: generated classification data (``data=synthetic``);
- ``tensor_files``: your own ``train.pt`` / ``eval.pt`` (``data=tensors``);
- ``lm_tokens``: generated language-model token walks (``data=lm_tokens``);
- ``images/``: image classification (``data=images_generated``, ``images_random``,
  ``images_folder``): generated images, transforms, image files and their checks, Hugging Face
  datasets, loaders, the builders;
- ``text/``: your own text as packed language-model batches (``data=text``): files, held-out
  split, tokenizer, packing, the builder;
- ``translation/``: multilingual parallel text (``data=translation``): corpus files, the
  generated corpus, shared vocabulary, batches, decoding, BLEU, the builder.

Imported by the runner (``bundle``) and, through a config's ``_target_``, by the entry point.
Imports ``giantpipe.config`` and, for decoding through a pipe, ``giantpipe.engine.generate``:
never the runner or ``models/`` (decoding reaches a model through the methods the model object
offers). Import from the modules; this package (and each folder's) stays empty so each pipeline
loads only what it needs.
"""
