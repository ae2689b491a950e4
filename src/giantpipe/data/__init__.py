"""Data: the ``data=`` options, each a builder returning a ``DataBundle`` (the runner's contract),
their schemas in one torch-free module.

Its modules: ``bundle`` (the contract), ``options`` (every option's schema), ``batch_order``
(the seeded order the in-memory options share), ``synthetic``, ``tensor_files``, ``lm_tokens``,
and the folders ``images/``, ``text/`` and ``translation/`` (one option family each). Import
from the modules: this package stays empty so each pipeline loads only what it needs
(docs/your-data.md#how-the-data-options-are-built).
"""
