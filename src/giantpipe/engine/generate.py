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

Both executors: a :class:`~giantpipe.GPipe` runs one worker thread per stage on the stage's
device; a ``DistributedPipe`` (one stage per rank) sends the messages between ranks on its host
group, so no rank holds more than its stages' weights and caches; a plain ``nn.Sequential``
decodes with the cache in the caller's thread.

Example::

    prompts = [(src, bos) for src, bos in zip(src_chunks, bos_chunks)]   # M micro-batches
    out = generate(pipe, prompts, steps=[40] * len(prompts), decoding=Decoding(beam_size=4,
                   eos_id=3, pad_id=0))
    out[m][row]                                                            # token ids
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    "one_stage_per_worker",
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
    ``end``: the last message of a call (every micro-batch done)."""

    m: int
    value: Value
    order: Tensor | None = None
    steps: int = 0
    end: bool = False


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


class Link(Protocol):
    """A stage's two ends of the ring: messages from the stage before, to the stage after."""

    def send(self, message: Message) -> None: ...

    def receive(self) -> Message: ...


def serve_stage(
    stage: StageCaches,
    link: Link,
    first: bool,
    last: bool,
    prompts: Sequence[Message],
    searches: Searches | None,
) -> None:
    """One stage's part of a call: its messages in arrival order until every micro-batch is
    done (stage 0 counts them and sends ``end`` around; the others stop when it comes)."""
    pending, finished = list(prompts) if first else [], 0  # prompts go in at stage 0 only
    if first and not pending:  # nothing to decode: the others hear it at once
        if not last:
            link.send(Message(-1, None, end=True))
        return
    while True:
        message = pending.pop(0) if pending else link.receive()
        if message.end:
            if not last:
                link.send(message)
            return
        if message.value is None:  # m is done: its caches go, and the word goes on
            stage.drop(message.m)
            finished += first
            if not last:
                link.send(message)
            if first and finished == len(prompts):  # every micro-batch is done
                if not last:
                    link.send(Message(-1, None, end=True))
                return
            continue
        out = stage.run(message.m, message.value, message.order)
        if last:
            assert searches is not None
            out = searches.advance(Message(message.m, out, steps=message.steps))
            link.send(out)
        else:
            link.send(Message(message.m, out, message.order, message.steps))


class LocalLink:
    """The ring between worker threads of one process: a :class:`Mailbox` keyed by stage and
    the count of messages the stage received (each stage has exactly one sender)."""

    def __init__(self, box: Mailbox, stage: int, stages: int) -> None:
        self.box, self.stage, self.next = box, stage, (stage + 1) % stages
        self.sent = self.received = 0

    def send(self, message: Message) -> None:
        self.box.put(("act", self.next, self.sent), message)
        self.sent += 1

    def receive(self) -> Message:
        message: Message = self.box.get(("act", self.stage, self.received))
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


def _generate_local(
    stages: Sequence[StageCaches], prompts: list[Message], decoding: Decoding, timeout: float
) -> dict[int, Tokens]:
    box, searches, k = Mailbox(timeout), Searches(decoding), len(stages)
    threads = _threads([st.device for st in stages])

    def task(s: int) -> Task:
        def serve() -> None:
            link = LocalLink(box, s, k)
            first, last = s == 0, s == k - 1
            serve_stage(stages[s], link, first, last, prompts if first else [], searches)

        return _worker(serve, stages[s].device, threads)

    tasks = [task(s) for s in range(k)]
    if k == 1:
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
    docstring) through ``pipe``: a GPipe (one thread per stage), a DistributedPipe (one stage
    per rank; ``prompts`` and ``steps`` are read where stage 0 is, and the result reaches every
    rank of the pipeline) or a plain Sequential. ``steps[m]``: most tokens micro-batch m
    generates. Returns, per micro-batch and row, the token ids without </s> and padding.

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
            results = _generate_local(_local_stages(pipe), messages, decoding, timeout)
        return [results[m] for m in range(len(results))]
    finally:
        pipe.train(was_training)


def one_stage_per_worker(pipe: nn.Module) -> bool:
    """Whether generation can run through ``pipe``: each worker (thread or rank) holds one
    stage, as generation needs (virtual stages, as interleaved schedules cut, do not).

    >>> one_stage_per_worker(nn.Sequential(nn.Linear(2, 2)))
    True
    """
    placement = list(getattr(pipe, "placement", [0]))
    return len(set(placement)) == len(placement)


def _local_stages(pipe: nn.Module) -> list[StageCaches]:
    partitions = getattr(pipe, "partitions", None)
    if partitions is None:  # a plain Sequential: one stage, the caller's thread
        device = next((p.device for p in pipe.parameters()), torch.device("cpu"))
        return [StageCaches(list(pipe.children()), device)]
    placement: list[int] = list(getattr(pipe, "placement", []))
    if len(set(placement)) != len(partitions):
        raise ValueError("generation runs one stage per worker (virtual stages: not supported)")
    devices: list[torch.device] = list(getattr(pipe, "devices", []))
    pairs = zip(partitions, devices, strict=True)
    return [StageCaches(list(part.children()), device) for part, device in pairs]


# ---- across ranks ----------------------------------------------------------------------------

HEADER_WORDS = 64
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPES += [torch.int64, torch.int32, torch.bool, torch.uint8]
TAG = 23  # generation's messages, apart from training's frames on the same pair of ranks


def _flatten(message: Message) -> tuple[list[int], list[Tensor]]:
    """A message as header words and its tensors (CPU, contiguous)."""
    value = message.value
    kind = 0 if value is None else 1 if isinstance(value, Tensor) else 2
    tensors = [] if value is None else [value] if kind == 1 else list(value)
    if message.order is not None:
        tensors.append(message.order)
    words = [message.m, kind, int(message.end), message.steps, int(message.order is not None)]
    words.append(len(tensors))
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
    then its tensors; sends are asynchronous (a rank computes on while its bytes travel, and
    no cycle of blocked sends can form around the ring), receives wait at most ``timeout``.

    Example::

        link = RankLink(pipe.groups.control, prev=3, next=1, timeout=60.0)
        link.send(Message(0, hidden)); message = link.receive(); link.finish()
    """

    def __init__(self, group: Any, prev: int, next: int, timeout: float) -> None:
        self.group, self.prev, self.next, self.timeout = group, prev, next, timeout
        self.sending: list[tuple[Any, list[Tensor]]] = []

    def send(self, message: Message) -> None:
        words, tensors = _flatten(message)
        parts = [torch.tensor(words, dtype=torch.int64), *tensors]
        works = [dist.isend(t, dst=self.next, group=self.group, tag=TAG) for t in parts]
        self.sending = [s for s in self.sending if not all(w.is_completed() for w in s[0])]
        self.sending.append((works, parts))

    def _receive(self, buffer: Tensor) -> Tensor:
        work = dist.irecv(buffer, src=self.prev, group=self.group, tag=TAG)
        assert work is not None  # this rank is in the group
        work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        return buffer

    def receive(self) -> Message:
        words = self._receive(torch.empty(HEADER_WORDS, dtype=torch.int64)).tolist()
        m, kind, end, steps, has_order, count = words[:6]
        tensors = []
        for i in range(count):
            code, ndim, *dims = words[6 + 6 * i : 12 + 6 * i]
            buffer = torch.empty(dims[:ndim], dtype=DTYPES[code])
            tensors.append(self._receive(buffer))
        order = tensors.pop() if has_order else None
        value = None if kind == 0 else tensors[0] if kind == 1 else tuple(tensors)
        return Message(m, value, order, steps, bool(end))

    def finish(self) -> None:
        for works, _ in self.sending:
            for work in works:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        self.sending.clear()


def _generate_distributed(
    pipe: Any, messages: list[Message], decoding: Decoding, timeout: float
) -> dict[int, Tokens]:
    """This rank's stage of the ring; the last stage's results broadcast over the pipeline."""
    layout = pipe.layout
    if len(layout.local_stages) != 1:
        raise ValueError("generation runs one stage per rank (virtual stages: not supported)")
    index, count = layout.local_stages[0], layout.num_stages
    stage = StageCaches(list(pipe.partitions[index].children()), pipe.device)
    last_rank = layout.rank_of_stage(count - 1)
    searches = Searches(decoding) if index == count - 1 else None
    if count == 1:
        results = _generate_local([stage], messages, decoding, timeout) if messages else {}
    else:
        prev, after = layout.rank_of_stage(index - 1), layout.rank_of_stage((index + 1) % count)
        link = RankLink(pipe.groups.control, prev, after, timeout)
        with torch.no_grad():
            serve_stage(stage, link, index == 0, index == count - 1, messages, searches)
        link.finish()
        results = searches.results if searches is not None else {}
    shared: list[Any] = [results]
    dist.broadcast_object_list(shared, src=last_rank, group=pipe.groups.host_pipeline)
    return dict(shared[0])
