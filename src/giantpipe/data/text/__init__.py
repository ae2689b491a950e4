"""Your own text as language-model batches: the ``data=text`` option, in the order it works.

- ``files``: the files the globs name (.txt, .jsonl, .parquet, saved ``datasets`` folders) read
  into documents, a problem naming the file and the line;
- ``split``: the held-out documents, drawn by seed;
- ``vocabulary``: the tokenizer (yours, or SentencePiece trained once and cached by content);
- ``packing``: documents' tokens packed into fixed-length rows, and the unigram baseline;
- ``bundle``: the option's builder, returning a DataBundle for the runner.

Import from the modules; this package stays empty so a run loads only what it needs.
"""
