"""The held-out split: whole documents, drawn by seed, never trained on."""

from __future__ import annotations

from pathlib import Path

import torch

from giantpipe.data.text.bundle import read_text_corpus


def test_documents_are_held_out_whole_and_by_seed(corpus: Path, tmp_path: Path) -> None:
    def split(seed: int) -> tuple[set[str], set[str]]:
        c = read_text_corpus([str(corpus / "*.txt")], 16, 200, seed=seed, cache_dir=str(tmp_path))
        decode = c.vocab.decode
        eos = c.vocab.eos_id

        def docs(rows: torch.Tensor) -> set[str]:
            ids = torch.cat([rows[:1, 0], rows[:, 1:].flatten()]).tolist()  # overlap by one
            pieces, current = [], []
            for token in ids:
                if token == eos:
                    pieces.append(decode(current))
                    current = []
                else:
                    current.append(token)
            return set(pieces[1:])  # the first may start mid-document only in theory: drop it

        return docs(c.train_rows), docs(c.valid_rows)

    train_docs, held_docs = split(seed=1)
    assert held_docs and not train_docs & held_docs  # no held-out document is trained on
    assert split(seed=1)[1] == held_docs
    assert split(seed=2)[1] != held_docs
