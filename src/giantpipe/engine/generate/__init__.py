"""Generation through the pipeline: incremental decoding, a key/value cache in every stage.

Each stage keeps the caches of its own layers, per micro-batch; a decode step carries only the
new positions from stage to stage, and the last stage's choice of the next tokens goes back to
stage 0. The sentences are split into M micro-batches that circle the ring of stages, so that
while stage k works on micro-batch m, stage k+1 works on m-1 (the pipeline stays full once
M >= K)::

    stage 0: prompt 0, prompt 1, ..., tokens of 0, tokens of 1, ...      (inputs: prompts, then
    stage 1:           prompt 0,  prompt 1, ..., tokens of 0, ...         the last stage's picks)
    last:    logits -> search -> (next tokens, which rows go on) ---> stage 0

A message (:mod:`.decoding`) carries a stage's output, or the next tokens with the rows they
continue. The search (:class:`Decoding`: greedy, beam with GNMT length penalty, or sampling with
temperature, top-k, top-p) runs where the logits are.

The model's children offer ``forward_cached(inputs, cache) -> (outputs, cache)``
(:mod:`.caches`); the engine knows nothing else of the model.

Both executors, any schedule's placement: a :class:`~giantpipe.GPipe` runs one thread per
worker, a ``DistributedPipe`` one process per worker (the messages between ranks travel on its
host group: the pipe gives the link, :mod:`giantpipe.engine.distributed.generation`), and a worker
holding V stages (interleaved, zb-v) keeps the caches of each, so a token's step goes round the
workers V times (:mod:`.ring`); no rank holds more than its stages' weights and caches (with
replicas sharded by FSDP2's ``full``, more than one layer whole: the replicas decode in
lockstep). A plain ``nn.Sequential`` decodes in the caller's thread.

Its parts, one concept each:

- :mod:`.decoding`: how the next token is chosen (:class:`Decoding`) and what travels the ring
  (``Message``);
- :mod:`.caches`: one stage's layers and their key/value caches per micro-batch;
- :mod:`.search`: greedy, sampled and beam search, where the logits are;
- :mod:`.prompts`: prompts of unequal length in one micro-batch, left-padded with a mask;
- :mod:`.ring`: the ring of stages: a worker's stages served from one inbox, the ring between
  threads, and the protocol of a ring between processes (a DistributedPipe gives it).

This package's own code is the entry, :func:`generate` (and :func:`split_rows` to cut a batch
into micro-batches, :func:`evaluating` for the modes it leaves as it found them); it imports no
torch.distributed.

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
