"""Evaluation: translation decoding and BLEU (``giantpipe.eval.translate``).

Import from the submodules; this package stays empty so each evaluation loads only what it needs.
"""
