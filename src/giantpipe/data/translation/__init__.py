"""Multilingual parallel text: the ``data=translation`` option, in parts.

- ``files``: parallel corpora as TSV, JSON Lines or parquet files, read with errors that name the
  file and the line;
- ``generated``: the generated multilingual corpus (artificial languages, one hidden grammar);
- ``vocabulary``: the shared SentencePiece vocabulary with ``<2xx>`` tokens, and encoding with it;
- ``batches``: temperature sampling over language pairs, token-bucketed resumable batches;
- ``decoding``: the reference greedy and beam decoders, and decoding through a pipe's stages;
- ``bleu``: sacreBLEU per language pair, the copy-the-source floor, held-out BLEU at evaluation;
- ``bundle``: the option's builder, returning a DataBundle for the runner.

Import from the modules; this package stays empty so a run loads only what it needs.
"""
