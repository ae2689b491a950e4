"""Configs the tests share: the quick starts shrunk to seconds, as ``train.py`` overrides."""

TRANSLATION = [
    "recipe=transformer_quickstart",
    "model.num_layers=1",
    "model.ffn_dim=32",
    "model.num_heads=2",
    "model.d_model=16",
    "model.head_dim=8",
    "data.generated_languages=2",
    "data.generated_train_sizes=[300,60]",
    "data.generated_eval_size=6",
    "data.vocab_size=200",
    "data.max_tokens=256",
    "data.bleu_sentences=3",
]
"""The translation quick start shrunk to seconds: a T(1, 32, 2) on two small generated languages
(each test appends its own ``trainer.*`` / ``logger.*`` overrides)."""
