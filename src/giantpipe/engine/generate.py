"""Generation through the pipeline: incremental decoding with a key/value cache in every stage.

Each stage keeps the caches of its own layers, per micro-batch; a decode step carries only the
new positions from stage to stage, and the last stage's choice of the next tokens goes back to
stage 0. The sentences are split into M micro-batches that circle the ring of stages, so that
while stage k works on micro-batch m, stage k+1 works on m-1 (the pipeline stays full once
M >= K)::

    stage 0: prompt 0, prompt 1, ..., tokens of 0, tokens of 1, ...      (inputs: prompts, then
    stage 1:           prompt 0,  prompt 1, ..., tokens of 0, ...         the last stage's picks)
    last:    logits -> search -> (next tokens, which rows go on) ---> stage 0

A message is ``(m, value, order)``: ``order`` says which rows of the previous step each row
continues (beam search picks the parents of its new beams, finished sentences leave; None when
every row goes on), and every stage reorders its caches with it before running the value; a
value of None says micro-batch m is done (the stages drop its caches). The search
(:class:`Decoding`: greedy, beam with GNMT length penalty, or sampling with temperature, top-k,
top-p) runs where the logits are.

The model's children offer ``forward_cached(inputs, cache) -> (outputs, cache)``: cache None on
the first call (the prompt), then what they returned, with ``cache.reorder(index)``; the last
child returns logits whose last position scores the next token (``models.transformer_layers``
describes the convention). The engine knows nothing else of the model.

Both executors, any schedule's placement: a :class:`~giantpipe.GPipe` runs one thread per
worker, a ``DistributedPipe`` one process per worker (the messages between ranks travel on its
host group), and a worker holding V stages (interleaved, zb-v) keeps the caches of each, so a
token's step goes round the workers V times (see "the ring" below); no rank holds more than its
stages' weights and caches. A plain ``nn.Sequential`` decodes in the caller's thread.

Example::

    prompts = [(src, bos) for src, bos in zip(src_chunks, bos_chunks)]   # M micro-batches
    out = generate(pipe, prompts, steps=[40] * len(prompts), decoding=Decoding(beam_size=4,
                   eos_id=3, pad_id=0))
    out[m][row]                                                            # token ids
"""

from __future__ import annotations

import datetime
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from giantpipe.engine.workers import Mailbox, WorkerPool

__all__ = [
    "Decoding",
    "Message",
    "StageCaches",
    "Searches",
    "generate",
    "split_rows",
    "check_cached",
    "held_stages",
]

Value = Any  # a tensor or a tuple of tensors (a stage boundary), or a token tensor [B, t]
Tokens = list[list[int]]  # per row of a micro-batch
Task = Callable[[], None]


@dataclass(frozen=True)
class Decoding:
    """How the next token is chosen. ``beam_size`` > 1: beam search; else ``temperature`` > 0
    samples (after ``top_k`` and ``top_p``), 0 takes the arg-max (greedy).

    ``eos_id`` ends a row (None: rows run ``steps`` tokens); ``pad_id`` tokens are dropped
    from the output (as the reference decoder in ``giantpipe.data.bleu`` does); ``seed`` makes
    sampling repeatable (micro-batch m draws from ``seed + m``).

    Example::

        Decoding(beam_size=4, length_penalty=0.6, eos_id=3, pad_id=0)   # translation
        Decoding(temperature=0.8, top_k=40, top_p=0.95, seed=1)         # a language model
    """

    beam_size: int = 1
    length_penalty: float = 0.6
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")
        if self.beam_size > 1 and self.temperature > 0:
            raise ValueError("choose beam search (beam_size > 1) or sampling (temperature > 0)")


@dataclass
class Message:
    """What travels the ring for micro-batch ``m``: a stage's output, or (to stage 0) the next
    tokens; ``value`` None: m is done. ``order``: rows of the previous step each row continues
    (None: every row, as it was).
    ``steps``: the most tokens m may generate (read by the last stage on m's first message).
    ``end``: the last message of a call (every micro-batch done). ``stage``: the stage it goes
    to (a worker may hold several)."""

    m: int
    value: Value
    order: Tensor | None = None
    steps: int = 0
    end: bool = False
    stage: int = 0


# ---- a stage: its layers and their caches --------------------------------------------------


def check_cached(layers: Sequence[nn.Module]) -> None:
    """Every child must offer ``forward_cached``; a TypeError names the first that does not.

    >>> check_cached([nn.Linear(2, 2)])
    Traceback (most recent call last):
    ...
    TypeError: generation needs forward_cached(inputs, cache) on every child; Linear lacks it
    """
    for layer in layers:
        if callable(getattr(layer, "forward_cached", None)):
            continue
        if isinstance(layer, torch.fx.GraphModule):  # a piece cut by engine.capture
            # whoever built the model may have said why it gave no caches (models.hf does)
            why = getattr(layer, "no_cache_reason", None) or (
                "its model gave it none (a Hugging Face causal LM's pieces get theirs from "
                "models.hf.give_caches(model, list(seq), seq.spans))"
            )
            raise TypeError(
                "generation needs forward_cached(inputs, cache) on every child; a piece "
                f"captured by sequentialize has no key/value cache: {why}"
            )
        raise TypeError(
            "generation needs forward_cached(inputs, cache) on every child; "
            f"{type(layer).__name__} lacks it"
        )


def _to(value: Value, device: torch.device) -> Value:
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(_to(v, device) for v in value)


class StageCaches:
    """One stage's children and, per micro-batch, their caches.

    Example::

        stage = StageCaches(list(model), torch.device("cpu"))
        logits = stage.run(0, (src, bos), None)               # the prompt: caches made
        logits = stage.run(0, next_tokens, order)             # one step: caches reordered, grown
        stage.drop(0)
    """

    def __init__(self, layers: Sequence[nn.Module], device: torch.device) -> None:
        check_cached(layers)
        self.layers, self.device = list(layers), device
        self.caches: dict[int, list[Any]] = {}

    def run(self, m: int, value: Value, order: Tensor | None) -> Value:
        caches = self.caches.get(m)
        if caches is None:
            caches = [None] * len(self.layers)
        elif order is not None:  # beams reordered, finished rows gone: in every layer's cache
            caches = [None if c is None else c.reorder(order) for c in caches]
        value = _to(value, self.device)
        for i, layer in enumerate(self.layers):
            value, caches[i] = layer.forward_cached(value, caches[i])  # type: ignore[operator]
        self.caches[m] = caches
        return value

    def drop(self, m: int) -> None:
        self.caches.pop(m, None)


# ---- the searches (where the logits are) ---------------------------------------------------


class Search(Protocol):
    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor | None] | None:
        """Given the logits [rows, V] of this step: (next tokens [rows', 1], order [rows'] or
        None when every row goes on as it is), or None when the micro-batch is done."""
        ...

    def result(self) -> Tokens: ...


def trim_tokens(ids: Sequence[int], eos_id: int | None, pad_id: int | None) -> list[int]:
    """A decoded row as the caller sees it: up to (not including) ``</s>``, padding left out."""
    out = []
    for i in ids:
        if i == eos_id:
            break
        if i != pad_id:
            out.append(int(i))
    return out


def _filtered(logits: Tensor, decoding: Decoding) -> Tensor:
    """Logits / temperature with all but the top-k and the top-p nucleus set to -inf."""
    logits = logits.float() / decoding.temperature
    if decoding.top_k is not None and decoding.top_k < logits.shape[-1]:
        kth = logits.topk(decoding.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if decoding.top_p is not None and decoding.top_p < 1:
        ordered, index = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
        ordered = ordered.masked_fill(before >= decoding.top_p, float("-inf"))  # keeps the top
        logits = torch.full_like(logits, float("-inf")).scatter(-1, index, ordered)
    return logits


class RowSearch:
    """Greedy or sampled decoding of a micro-batch: one token per row and step; a row that
    chose </s> leaves (its caches are dropped with it)."""

    def __init__(self, rows: int, steps: int, decoding: Decoding, m: int) -> None:
        self.decoding, self.steps = decoding, steps
        self.tokens: Tokens = [[] for _ in range(rows)]
        self.alive = list(range(rows))  # original row of each current row
        self.generator = torch.Generator().manual_seed(decoding.seed + m)

    def _pick(self, logits: Tensor) -> Tensor:
        if self.decoding.temperature == 0:
            return logits.argmax(dim=-1)
        probs = _filtered(logits, self.decoding).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor | None] | None:
        picked = self._pick(logits.cpu()).tolist()
        keep = []
        for row, token in enumerate(picked):
            self.tokens[self.alive[row]].append(token)
            if token != self.decoding.eos_id:
                keep.append(row)
        every = len(keep) == len(self.alive)
        self.alive = [self.alive[row] for row in keep]
        if not keep or len(self.tokens[self.alive[0]]) >= self.steps:
            return None
        # every row goes on: no order, so that no stage copies its caches for nothing
        return torch.tensor([[picked[row]] for row in keep]), None if every else torch.tensor(keep)

    def result(self) -> Tokens:
        return [trim_tokens(t, self.decoding.eos_id, self.decoding.pad_id) for t in self.tokens]


def _length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha, as the reference decoder's."""
    return ((5.0 + length) / 6.0) ** alpha


@dataclass
class _Beams:
    """One sentence: live (score, tokens, row of its parent) and finished (norm, tokens)."""

    live: list[tuple[float, list[int], int]]
    done: list[tuple[float, list[int]]] = field(default_factory=list)


class BeamSearch:
    """Beam search over a micro-batch with the reference decoder's rules (fairseq's): a
    candidate ending in </s> is kept only if it ranks within the top ``beam_size``; a sentence
    stops once ``beam_size`` hypotheses ended; at ``steps`` the live ones are scored as they are.
    """

    def __init__(self, rows: int, steps: int, decoding: Decoding) -> None:
        self.decoding, self.steps, self.taken = decoding, steps, 0
        self.beams = [_Beams([(0.0, [], row)]) for row in range(rows)]

    def _active(self) -> list[int]:
        size = self.decoding.beam_size
        return [i for i, b in enumerate(self.beams) if len(b.done) < size and b.live]

    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor | None] | None:
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        start = 0
        for i in self._active():  # the rows are the live beams of the active sentences
            count = len(self.beams[i].live)
            self._advance(self.beams[i], logprobs[start : start + count], start)
            start += count
        self.taken += 1
        active = self._active()
        if not active or self.taken >= self.steps:
            return None
        live = [beam for i in active for beam in self.beams[i].live]
        return torch.tensor([[t[-1]] for _, t, _ in live]), torch.tensor([p for _, _, p in live])

    def _advance(self, beams: _Beams, logprobs: Tensor, first_row: int) -> None:
        size, eos, alpha = (
            self.decoding.beam_size,
            self.decoding.eos_id,
            self.decoding.length_penalty,
        )
        scores = torch.tensor([s for s, _, _ in beams.live], dtype=logprobs.dtype)[:, None]
        scores = scores + logprobs
        top, flat = scores.flatten().topk(min(2 * size, scores.numel()))
        vocab = logprobs.shape[1]
        live: list[tuple[float, list[int], int]] = []
        for rank, (score, index) in enumerate(zip(top.tolist(), flat.tolist(), strict=True)):
            parent, token = index // vocab, index % vocab
            tokens = beams.live[parent][1] + [token]
            if token == eos:
                if rank < size and len(beams.done) < size:
                    # the penalty's length counts </s>, not <s> (as the reference's)
                    beams.done.append((score / _length_penalty(len(tokens), alpha), tokens[:-1]))
            elif len(live) < size:
                live.append((score, tokens, first_row + parent))
        beams.live = live

    def result(self) -> Tokens:
        alpha, out = self.decoding.length_penalty, []
        for b in self.beams:
            pool = b.done + [(s / _length_penalty(len(t), alpha), t) for s, t, _ in b.live]
            best = max(pool, key=lambda item: item[0])[1]
            out.append(trim_tokens(best, self.decoding.eos_id, self.decoding.pad_id))
        return out


class Searches:
    """The last stage's searches, one per micro-batch, made when its first logits arrive.

    Example::

        searches = Searches(Decoding(beam_size=4, eos_id=3))
        reply = searches.advance(Message(0, logits, steps=40))  # next tokens, or done
        searches.results[0]
    """

    def __init__(self, decoding: Decoding) -> None:
        self.decoding = decoding
        self.running: dict[int, Search] = {}
        self.results: dict[int, Tokens] = {}

    def advance(self, message: Message) -> Message:
        m, logits = message.m, message.value[:, -1]
        search = self.running.get(m)
        if search is None:
            rows, steps = logits.shape[0], message.steps
            search = (
                BeamSearch(rows, steps, self.decoding)
                if self.decoding.beam_size > 1
                else RowSearch(rows, steps, self.decoding, m)
            )
            self.running[m] = search
        step = search.advance(logits)
        if step is None:
            self.results[m] = self.running.pop(m).result()
            return Message(m, None)
        return Message(m, step[0], step[1])


# ---- the ring ------------------------------------------------------------------------------
#
# The ring runs over stages, not workers: stage s sends to s + 1, the last stage to stage 0.
# A worker holding V stages (interleaved: s on worker s % K; zb-v: s and 2K-1-s on one) serves
# all of them from one inbox, so a decode step goes round the workers V times per token:
#
#     interleaved K=2 V=2:  worker 0: stages 0, 2     0 -> 1 -> 2 -> 3 -> (search) -> 0
#                           worker 1: stages 1, 3     w0   w1   w0   w1               w0
#     zb-v K=2:             worker 0: stages 0, 3     0 -> 1 -> 2 -> 3 -> (search) -> 0
#                           worker 1: stages 1, 2     w0   w1   w1   w0               w0
#
# A message to a stage of the same worker stays in the worker's own queue (served before the
# link, so a worker never waits on the link for work it holds itself).


class Link(Protocol):
    """A worker's ends of the ring: a message goes to the worker of ``message.stage``;
    ``receive`` takes the next message sent to any of this worker's stages."""

    def send(self, message: Message) -> None: ...

    def receive(self) -> Message: ...


class StageServer:
    """One worker's stages (``stages``: index -> its caches, of ``count`` in the ring) for one
    call: the messages to any of them in arrival order, until each has heard ``end`` (stage 0
    counts the micro-batches done and sends ``end`` round; the others pass it on).

    Example::

        StageServer({0: first, 2: third}, 4, link, prompts, None).serve()   # worker 0 of 2
    """

    def __init__(
        self,
        stages: dict[int, StageCaches],
        count: int,
        link: Link,
        prompts: Sequence[Message],
        searches: Searches | None,
    ) -> None:
        self.stages, self.count, self.link, self.searches = stages, count, link, searches
        self.prompts = list(prompts) if 0 in stages else []  # prompts go in at stage 0 only
        self.here: deque[Message] = deque(self.prompts)
        self.open, self.finished = set(stages), 0

    def serve(self) -> None:
        if 0 in self.stages and not self.prompts:  # nothing to decode: the others hear it
            self._end()
        while self.open:
            self._handle(self.here.popleft() if self.here else self.link.receive())

    def _send(self, message: Message) -> None:
        if message.stage in self.stages:
            self.here.append(message)
        else:
            self.link.send(message)

    def _pass_on(self, message: Message) -> None:
        if message.stage < self.count - 1:  # the last stage is where the word stops
            self._send(replace(message, stage=message.stage + 1))

    def _end(self) -> None:
        self.open.discard(0)
        self._pass_on(Message(-1, None, end=True, stage=0))

    def _handle(self, message: Message) -> None:
        s = message.stage
        if message.end:
            self.open.discard(s)
            self._pass_on(message)
        elif message.value is None:  # m is done: its caches go, and the word goes on
            self.stages[s].drop(message.m)
            self._pass_on(message)
            self.finished += s == 0
            if s == 0 and self.finished == len(self.prompts):  # every micro-batch is done
                self._end()
        elif s == self.count - 1:  # the logits: the search picks the next tokens
            out = self.stages[s].run(message.m, message.value, message.order)
            assert self.searches is not None
            reply = self.searches.advance(Message(message.m, out, steps=message.steps))
            self._send(replace(reply, stage=0))
        else:
            out = self.stages[s].run(message.m, message.value, message.order)
            self._send(Message(message.m, out, message.order, message.steps, stage=s + 1))


class LocalPost:
    """The ring between worker threads of one process: a :class:`Mailbox` keyed by receiving
    worker and arrival number. A worker holding several stages hears several senders, so the
    number is drawn under a lock by whoever sends (each sender's messages keep their order)."""

    def __init__(self, box: Mailbox, placement: Sequence[int]) -> None:
        self.box, self.placement = box, list(placement)
        self.sent = [0] * (max(self.placement) + 1)
        self.lock = threading.Lock()

    def send(self, message: Message) -> None:
        worker = self.placement[message.stage]
        with self.lock:
            self.box.put(("act", worker, self.sent[worker]), message)
            self.sent[worker] += 1


class LocalLink:
    """Worker ``worker``'s ends of a :class:`LocalPost`."""

    def __init__(self, post: LocalPost, worker: int) -> None:
        self.post, self.worker, self.received = post, worker, 0

    def send(self, message: Message) -> None:
        self.post.send(message)

    def receive(self) -> Message:
        message: Message = self.post.box.get(("act", self.worker, self.received))
        self.received += 1
        return message


def _threads(devices: Sequence[torch.device]) -> int | None:
    cpu = sum(d.type == "cpu" for d in devices)
    return max(1, torch.get_num_threads() // cpu) if cpu > 1 else None


def _worker(
    task: Callable[[], None], device: torch.device, threads: int | None
) -> Callable[[], None]:
    def run() -> None:
        before = torch.get_num_threads()
        if threads is not None and device.type == "cpu":
            torch.set_num_threads(threads)  # stand-ins share the cores, as the executor's
        try:
            with torch.no_grad():
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        task()
                else:
                    task()
        finally:
            torch.set_num_threads(before)  # as the executor's workers: the count given back

    return run


def held_stages(placement: Sequence[int], worker: int) -> list[int]:
    """The stages ``worker`` holds, in ring order.

    >>> held_stages((0, 1, 1, 0), 0)   # zb-v, K = 2
    [0, 3]
    """
    return [s for s, w in enumerate(placement) if w == worker]


def _generate_local(
    stages: Sequence[StageCaches],
    placement: Sequence[int],
    prompts: list[Message],
    decoding: Decoding,
    timeout: float,
) -> dict[int, Tokens]:
    box, searches = Mailbox(timeout), Searches(decoding)
    post, workers = LocalPost(box, placement), sorted(set(placement))
    devices = [stages[held_stages(placement, w)[0]].device for w in workers]
    threads = _threads(devices)

    def task(w: int) -> Task:
        held = {s: stages[s] for s in held_stages(placement, w)}

        def serve() -> None:
            StageServer(held, len(stages), LocalLink(post, w), prompts, searches).serve()

        return _worker(serve, devices[w], threads)

    tasks = [task(w) for w in workers]
    if len(tasks) == 1:
        tasks[0]()  # the caller's thread: nothing to overlap
    else:
        pool = WorkerPool()
        try:
            pool.run(tasks, timeout)
        except BaseException:
            box.abort()
            raise
        finally:
            pool.close()
    return searches.results


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
    is, and the result reaches every rank of the pipeline) or a plain Sequential. Any schedule's
    placement: with virtual stages a worker keeps the caches of each stage it holds.
    ``steps[m]``: most tokens micro-batch m generates. Returns, per micro-batch and row, the
    token ids without </s> and padding.

    Example::

        out = generate(pipe, split_rows(prompt_tokens, 4), [32] * 4, Decoding(temperature=0.8))
    """
    was_training = pipe.training
    pipe.eval()
    try:
        messages = [Message(m, p, None, steps[m]) for m, p in enumerate(prompts or [])]
        if hasattr(pipe, "layout"):
            results = _generate_distributed(pipe, messages, decoding, timeout)
        elif not messages:
            return []
        else:
            stages, placement = _local_stages(pipe)
            results = _generate_local(stages, placement, messages, decoding, timeout)
        return [results[m] for m in range(len(results))]
    finally:
        pipe.train(was_training)


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


# ---- across ranks ----------------------------------------------------------------------------

HEADER_WORDS = 64
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPES += [torch.int64, torch.int32, torch.bool, torch.uint8]
TAG = 23  # generation's messages, apart from training's frames on the same pair of ranks
FIXED_WORDS = 7  # m, kind, end, steps, has order, stage, tensor count; then 6 per tensor


def _flatten(message: Message) -> tuple[list[int], list[Tensor]]:
    """A message as header words and its tensors (CPU, contiguous)."""
    value = message.value
    kind = 0 if value is None else 1 if isinstance(value, Tensor) else 2
    tensors = [] if value is None else [value] if kind == 1 else list(value)
    if message.order is not None:
        tensors.append(message.order)
    words = [message.m, kind, int(message.end), message.steps, int(message.order is not None)]
    words += [message.stage, len(tensors)]
    for t in tensors:
        if t.dim() > 4:
            raise ValueError(f"generation sends tensors of at most 4 dimensions, got {t.dim()}")
        words += [DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (4 - t.dim())]
    if len(words) > HEADER_WORDS:
        raise ValueError(f"a generation message holds too many tensors ({len(tensors)})")
    return words + [0] * (HEADER_WORDS - len(words)), [
        t.detach().cpu().contiguous() for t in tensors
    ]


class RankLink:
    """The ring between ranks, on a host (gloo) group: a message is a header of int64 words,
    then its tensors, sent to the rank of ``message.stage`` (``ranks``: stage -> global rank);
    sends are asynchronous (a rank computes on while its bytes travel, and no cycle of blocked
    sends can form around the ring), receives wait at most ``timeout``.

    A rank hears the ranks holding the stages before its own: one with one stage per rank or
    interleaved placement (the rank before), two under zb-v (the ranks on either side). With
    two, the header is taken from whichever sends first and the tensors then from that rank:
    gloo keeps each sender's messages in order, so a header always meets a header.

    Example::

        link = RankLink(pipe.groups.control, ranks=[0, 1, 0, 1], rank=0, timeout=60.0)
        link.send(Message(0, hidden, stage=1)); message = link.receive(); link.finish()
    """

    def __init__(self, group: Any, ranks: Sequence[int], rank: int, timeout: float) -> None:
        self.group, self.ranks, self.timeout = group, list(ranks), timeout
        held = [s for s, r in enumerate(self.ranks) if r == rank]
        senders = {self.ranks[s - 1] for s in held} - {rank}  # stage -1: the last one
        self.source: int | None = senders.pop() if len(senders) == 1 else None  # None: any
        self.sending: list[tuple[Any, list[Tensor]]] = []

    def send(self, message: Message) -> None:
        words, tensors = _flatten(message)
        parts = [torch.tensor(words, dtype=torch.int64), *tensors]
        dst = self.ranks[message.stage]
        works = [dist.isend(t, dst=dst, group=self.group, tag=TAG) for t in parts]
        self.sending = [s for s in self.sending if not all(w.is_completed() for w in s[0])]
        self.sending.append((works, parts))

    def _receive(self, buffer: Tensor, source: int | None) -> int:
        """Fills ``buffer`` from ``source`` (None: any rank); returns the sender's rank."""
        work = dist.irecv(buffer, src=source, group=self.group, tag=TAG)
        assert work is not None  # this rank is in the group
        work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        if source is not None:
            return source
        return dist.get_global_rank(self.group, work._source_rank())  # noqa: SLF001

    def receive(self) -> Message:
        header = torch.empty(HEADER_WORDS, dtype=torch.int64)
        sender = self._receive(header, self.source)
        words = header.tolist()
        m, kind, end, steps, has_order, stage, count = words[:FIXED_WORDS]
        tensors = []
        for i in range(count):
            code, ndim, *dims = words[FIXED_WORDS + 6 * i : FIXED_WORDS + 6 * (i + 1)]
            buffer = torch.empty(dims[:ndim], dtype=DTYPES[code])
            self._receive(buffer, sender)
            tensors.append(buffer)
        order = tensors.pop() if has_order else None
        value = None if kind == 0 else tensors[0] if kind == 1 else tuple(tensors)
        return Message(m, value, order, steps, bool(end), stage)

    def finish(self) -> None:
        for works, _ in self.sending:
            for work in works:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        self.sending.clear()


def _generate_distributed(
    pipe: Any, messages: list[Message], decoding: Decoding, timeout: float
) -> dict[int, Tokens]:
    """This rank's stages of the ring; the last stage's results broadcast over the pipeline."""
    layout = pipe.layout
    count, mine = layout.num_stages, layout.local_stages
    held = {s: StageCaches(list(pipe.partitions[s].children()), pipe.device) for s in mine}
    ranks = [layout.rank_of_stage(s) for s in range(count)]
    searches = Searches(decoding) if count - 1 in held else None
    link = RankLink(pipe.groups.control, ranks, layout.rank, timeout)
    with torch.no_grad():
        StageServer(held, count, link, messages, searches).serve()
    link.finish()
    shared: list[Any] = [searches.results if searches is not None else {}]
    dist.broadcast_object_list(shared, src=ranks[-1], group=pipe.groups.host_pipeline)
    return dict(shared[0])
