"""Generation through the pipeline: incremental decoding, a key/value cache in every stage.

:func:`generate` circles M micro-batches round the ring of stages (any executor, any
placement; docs/generation.md#inside-the-ring-and-its-messages). Its parts: :mod:`.decoding`
(how the next token is chosen, the ring's messages), :mod:`.caches` (a stage's layers and
caches), :mod:`.search` (greedy, sampled, beam), :mod:`.prompts` (prompts of unequal length),
:mod:`.ring` (the ring between threads, and what one between processes offers).

Example::

    prompts = [(src, bos) for src, bos in zip(src_chunks, bos_chunks)]   # M micro-batches
    out = generate(pipe, prompts, steps=[40] * len(prompts), decoding=Decoding(beam_size=4,
                   eos_id=3, pad_id=0))
    out[m][row]                                                            # token ids
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from giantpipe.engine.generate.caches import StageCaches
from giantpipe.engine.generate.decoding import Decoding, Message, Tokens, Value
from giantpipe.engine.generate.prompts import padded_prompt, prompt_input
from giantpipe.engine.generate.ring import generate_local, serve_held_stages

__all__ = ["Decoding", "evaluating", "generate", "padded_prompt", "split_rows"]


def split_rows(batch: Value, chunks: int) -> list[Value]:
    """``batch`` (a tensor or tuple of tensors, rows first) cut into at most ``chunks``
    micro-batches of consecutive rows, as even as possible.

    >>> [t.shape[0] for t in split_rows(torch.zeros(5, 2), 2)]
    [3, 2]
    """
    rows = (batch if isinstance(batch, Tensor) else batch[0]).shape[0]
    chunks = max(1, min(chunks, rows))
    if isinstance(batch, Tensor):
        return list(batch.tensor_split(chunks))
    return list(zip(*(t.tensor_split(chunks) for t in batch), strict=True))


def generate(
    pipe: nn.Module,
    prompts: Sequence[Value] | None,
    steps: Sequence[int],
    decoding: Decoding,
    timeout: float = 300.0,
) -> list[Tokens]:
    """Decodes every micro-batch of ``prompts`` (stage 0's first inputs; see the module
    docstring) through ``pipe``: a GPipe (one thread per worker, serving each of its stages),
    a DistributedPipe (one process per worker; ``prompts`` and ``steps`` are read where stage 0
    is, and the result reaches every rank of the pipeline; with replicas every rank of the world
    calls it, each replica with its own prompts) or a plain Sequential. Any schedule's
    placement: with virtual stages a worker keeps the caches of each stage it holds.
    A language model's micro-batch may hold prompts of unequal length: a list of rows, or a
    tensor left-padded with ``decoding.pad_id`` (:mod:`.prompts`); each row decodes as that
    prompt alone. ``steps[m]``: most tokens micro-batch m generates. Returns, per micro-batch
    and row, the token ids without </s> and padding. Every module of ``pipe`` is left in the
    mode it was found in (:func:`evaluating`), also when decoding fails.

    Example::

        out = generate(pipe, split_rows(prompt_tokens, 4), [32] * 4, Decoding(temperature=0.8))
        out = generate(model, [[[5, 6, 7], [8, 9]]], [16], Decoding())   # two lengths, one batch
    """
    given = list(prompts or [])
    if len(steps) < len(given):
        raise ValueError(f"{len(given)} micro-batches of prompts but {len(steps)} steps")
    inputs = [prompt_input(p, decoding.pad_id, m) for m, p in enumerate(given)]
    with evaluating(pipe):
        messages = [Message(m, p, None, steps[m]) for m, p in enumerate(inputs)]
        ring = getattr(pipe, "generation_link", None)  # a pipe over processes gives its own
        if ring is not None:
            results = serve_held_stages(pipe, ring(timeout), messages, decoding)
        elif not messages:
            return []
        else:
            stages, placement = _local_stages(pipe)
            results = generate_local(stages, placement, messages, decoding, timeout)
        return [results[m] for m in range(len(results))]


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode inside the block; after it, each of its submodules in the mode
    it was found in (``module.train(was)`` would set them all alike), also on error.

    >>> model = nn.Sequential(nn.Dropout(), nn.Dropout()).train()
    >>> model[1].eval()
    Dropout(p=0.5, inplace=False)
    >>> with evaluating(model):
    ...     model[0].training
    False
    >>> [model.training, model[0].training, model[1].training]
    [True, True, False]
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _local_stages(pipe: nn.Module) -> tuple[list[StageCaches], list[int]]:
    """Every stage of a local pipe (or a plain Sequential: one) and the worker of each."""
    partitions = getattr(pipe, "partitions", None)
    if partitions is None:  # a plain Sequential: one stage, the caller's thread
        device = next((p.device for p in pipe.parameters()), torch.device("cpu"))
        return [StageCaches(list(pipe.children()), device)], [0]
    devices: list[torch.device] = list(getattr(pipe, "devices", []))  # per stage
    pairs = zip(partitions, devices, strict=True)
    stages = [StageCaches(list(part.children()), device) for part, device in pairs]
    return stages, list(getattr(pipe, "placement", range(len(stages))))
