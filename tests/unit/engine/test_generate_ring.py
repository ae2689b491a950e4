"""The ring's stage server (engine/generate/ring.py) in one process: a worker serves its
messages in one order (token step, stage, micro-batch) whatever order they arrive in; in
lockstep a micro-batch done here walks the ring as a ghost while the replicas go on, and a ghost
gathers each layer as a real step does, computing nothing, while the tokens stay this replica's
own."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from giantpipe.engine.generate import Decoding, generate
from giantpipe.engine.generate.caches import StageCaches
from giantpipe.engine.generate.decoding import Message
from giantpipe.engine.generate.ring import StageServer
from giantpipe.engine.generate.search import Searches
from models.transformer import transformer_lm


class Queue:
    """A link whose messages arrive in the order given; what is sent is kept."""

    def __init__(self, arriving: list[Message]) -> None:
        self.arriving, self.sent = deque(arriving), []

    def receive(self) -> Message:
        return self.arriving.popleft()

    def send(self, message: Message) -> None:
        self.sent.append(message)


class Stage:
    """A stage whose runs are written down."""

    def __init__(self) -> None:
        self.runs: list[int] = []

    def run(self, m: int, value: object, order: object) -> object:
        self.runs.append(m)
        return value

    def drop(self, m: int) -> None:
        pass


def test_a_worker_serves_its_messages_in_step_order_whatever_their_arrival() -> None:
    """Stage 1 of 3, two micro-batches: m = 1 arrives first, m = 0 is served first."""
    value = torch.zeros(1)
    arriving = [Message(1, value, stage=1), Message(0, value, stage=1)]
    arriving += [Message(1, None, stage=1), Message(0, None, stage=1)]
    stage, link = Stage(), Queue(arriving)
    StageServer({1: stage}, 3, link, [], None, micro_batches=2).serve()  # type: ignore[dict-item]
    assert stage.runs == [0, 1]
    assert [(m.m, m.stage, m.value is None) for m in link.sent] == [
        (0, 2, False),
        (1, 2, False),
        (0, 2, True),
        (1, 2, True),
    ]


def lm() -> nn.Sequential:
    torch.manual_seed(3)
    return transformer_lm(2, d_model=16, ffn_dim=32, num_heads=2, vocab_size=23, max_len=48).eval()


@contextmanager
def noted(held: list[int], index: dict[int, int], layer: nn.Module) -> Iterator[None]:
    held.append(index[id(layer)])
    yield


def test_in_lockstep_a_done_micro_batch_walks_the_ring_as_a_ghost_gathering_each_layer() -> None:
    """One worker holding both stages; the replicas (a fake agreement) decode 7 steps and two
    micro-batches, this one 3 steps of one: its step sequence, the layers it holds, is that of
    7 steps of 2 micro-batches; its tokens are its own."""
    model = lm()
    index = {id(layer): i for i, layer in enumerate(model)}
    held: list[int] = []
    stages = {
        s: StageCaches(list(model)[a:b], torch.device("cpu"), lambda l: noted(held, index, l))
        for s, (a, b) in enumerate([(0, 2), (2, 4)])
    }
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    agreed = {"asked": 0}

    def goes_on(going: bool) -> bool:  # the other replica's micro-batches take 7 steps each
        agreed["asked"] += 1  # asked for m = 0, 1, 0, 1, ...: the 13th and 14th end them
        return going or agreed["asked"] <= 12

    searches = Searches(Decoding())
    prompts = [Message(0, prompt, steps=3)]
    server = StageServer(stages, 2, Queue([]), prompts, searches, 2, goes_on)  # type: ignore[arg-type]
    with torch.no_grad():
        server.serve()
    assert agreed["asked"] == 14  # 7 steps of each micro-batch, decided at the last stage
    assert held == [0, 1, 0, 1, 2, 3, 2, 3] * 7  # stage 0 of m = 0, 1, then stage 1; 7 times
    assert searches.results[0] == generate(lm(), [prompt], [3], Decoding())[0]
    assert list(searches.results) == [0]  # the ghost micro-batch has no tokens
