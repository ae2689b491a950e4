"""The local executor's failure path, as the user sees it (torchgpipe's, and better).

- A stage's exception reaches the caller as it was raised (``except ValueError``,
  ``except torch.OutOfMemoryError``), with a note naming the stage, device and micro-batch;
  KeyboardInterrupt and SystemExit stay what they are; the engine's own failures are
  PipelineError (PipelineTimeout).
- Failure is prompt: the caller hears within moments of the failing action, not after a slow
  neighbour finished its micro-batches; a short timeout surfaces near the timeout; Ctrl-C does
  not wait for a slow stage; the other workers stop at their next action.
- The same pipe runs again right after (batch-size back-off), and no thread is left behind.

Timings have wide margins: the suite shares 2 loaded cores with other jobs.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from giantpipe import GPipe, PipelineError
from giantpipe.engine import PipelineTimeout, failed_action
from giantpipe.engine.mailbox import Mailbox
from giantpipe.engine.schedules.actions import Action


class Boom(nn.Module):
    """Raises ``exc`` from its ``after+1``-th call on (``exc=None``: passes through)."""

    def __init__(self, exc: BaseException | None, after: int = 0) -> None:
        super().__init__()
        self.exc, self.after, self.calls = exc, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.exc is not None and self.calls > self.after:
            raise self.exc
        return x


class Slow(nn.Module):
    """Sleeps ``seconds`` per call, or blocks until ``release`` is set (at most 30 s)."""

    def __init__(self, seconds: float = 0.0, block: bool = False) -> None:
        super().__init__()
        self.seconds, self.block, self.calls = seconds, block, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.entered.set()
        if self.block:
            self.release.wait(30)
        time.sleep(self.seconds)
        return x


class CustomError(Exception):
    pass


def worker_threads() -> list[threading.Thread]:
    gc.collect()  # a pipe's threads end with the pipe: collect earlier tests' unreachable ones
    return [t for t in threading.enumerate() if t.name.startswith("giantpipe-worker")]


def wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def released() -> Iterator[list[Slow]]:
    """Blocking layers registered here are released when the test ends, pass or fail."""
    layers: list[Slow] = []
    yield layers
    for layer in layers:
        layer.block = False
        layer.release.set()


def batch(n: int = 16, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, d), torch.randn(n, 1)


def step(pipe: GPipe, door: str, n: int = 16) -> None:
    x, y = batch(n)
    if door == "forward":
        nn.functional.mse_loss(pipe(x), y).backward()
    else:
        pipe.train_step(x, y, nn.functional.mse_loss)


# ---- original exception types --------------------------------------------------------------

RAISED = [
    (ValueError, "bad value"),
    (torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"),
    (CustomError, "custom"),
]


@pytest.mark.slow
@pytest.mark.parametrize("door", ["forward", "train_step"])
@pytest.mark.parametrize(("kind", "message"), RAISED, ids=[k.__name__ for k, _ in RAISED])
def test_a_stage_exception_keeps_its_type_and_gets_a_note(
    door: str, kind: type[Exception], message: str
) -> None:
    exc = kind(message)
    boom = Boom(exc, after=1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), boom, nn.Linear(8, 1))
    pipe = GPipe(model, [1, 1, 2], devices=["cpu"] * 3, chunks=4)
    before = set(worker_threads())
    start = time.monotonic()
    with pytest.raises(type(exc)) as info:
        step(pipe, door)
    assert time.monotonic() - start < 5
    assert info.value is exc  # the very object the layer raised, its traceback included
    assert any(
        entry.name == "forward" and "raise self.exc" in str(entry.statement)
        for entry in info.traceback
    )
    assert not isinstance(info.value, PipelineError)
    assert info.value.__notes__ == [
        "giantpipe: stage 2 (device cpu) failed on micro-batch 1 (forward)"
    ]
    assert failed_action(info.value) == Action("F", 2, 1)
    assert wait_until(lambda: set(worker_threads()) <= before)  # the failed step's threads end
    boom.exc = None
    step(pipe, door)  # the pipe is usable again


@pytest.mark.slow
@pytest.mark.parametrize("door", ["forward", "train_step"])
def test_an_exception_in_backward_names_the_stage(door: str) -> None:
    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            raise ValueError("bad gradient")

    class Layer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return BadGrad.apply(x)

    model = nn.Sequential(nn.Linear(8, 8), Layer(), nn.Linear(8, 1))
    pipe = GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2, checkpoint="never")
    before = set(worker_threads())
    with pytest.raises(ValueError, match="bad gradient") as info:
        step(pipe, door)
    assert len(info.value.__notes__) == 1
    assert info.value.__notes__[0].startswith("giantpipe: stage 1 (device cpu) failed on ")
    assert info.value.__notes__[0].endswith("(backward)")
    assert wait_until(lambda: set(worker_threads()) <= before)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_keyboard_interrupt_and_system_exit_from_a_stage_are_not_converted(
    kind: type[BaseException],
) -> None:
    exc = kind()
    pipe = GPipe(nn.Sequential(nn.Linear(8, 8), Boom(exc)), [1, 1], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(type(exc)) as info:
        step(pipe, "train_step")
    assert info.value is exc
    assert info.value.__notes__ == [
        "giantpipe: stage 1 (device cpu) was stopped on micro-batch 0 (forward)"
    ]


def test_out_of_memory_back_off_retries_on_the_same_pipe() -> None:
    """``except torch.OutOfMemoryError``: halve the batch and retry, as with torchgpipe; the
    failed steps hold no memory once the exception is dropped (nothing but it refers to them)."""
    outputs: list[weakref.ref[torch.Tensor]] = []

    class Track(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            outputs.append(weakref.ref(y))
            return y

    class OutOfMemoryAbove(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return x

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), Track(), nn.Linear(8, 8), OutOfMemoryAbove(), nn.Linear(8, 1)
    )
    pipe = GPipe(model, [2, 3], devices=["cpu", "cpu"], chunks=2)
    x, y = batch(32)
    size, failures = 32, 0
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        while True:
            try:
                pipe.train_step(x[:size], y[:size], nn.functional.mse_loss)
                break
            except torch.OutOfMemoryError:
                failures += 1
            size //= 2
        pipe.close()  # joins the threads of the failed steps
        assert size == 8 and failures == 2
        assert all(ref() is None for ref in outputs)
    finally:
        gc.enable()


# ---- prompt failure ------------------------------------------------------------------------


@pytest.mark.parametrize("door", ["forward", "train_step"])
def test_failure_surfaces_before_a_slow_neighbour_finishes(door: str) -> None:
    """Stage 0 takes 0.5 s per micro-batch (4 s for 8); stage 1 fails on the first: the caller
    hears after about 0.5 s, and stage 0 stops at its next action."""
    slow = Slow(seconds=0.5)
    model = nn.Sequential(slow, nn.Linear(8, 8), Boom(ValueError("boom")))
    pipe = GPipe(model, [1, 2], devices=["cpu"] * 2, chunks=8)
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom"):
        step(pipe, door)
    assert time.monotonic() - start < 2.0  # the sum is 4 s
    time.sleep(1.0)
    assert slow.calls <= 3  # the one running when stage 1 failed, perhaps the next; not 8


def test_a_short_timeout_surfaces_near_the_timeout(released: list[Slow]) -> None:
    slow = Slow(block=True)
    released.append(slow)
    pipe = GPipe(nn.Sequential(slow, nn.Linear(8, 1)), [1, 1], devices=["cpu"] * 2, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(
        PipelineTimeout, match="waited 1s for the activation of micro-batch 0 into stage 1"
    ) as info:
        step(pipe, "train_step")
    assert 0.9 < time.monotonic() - start < 3.0  # not when the blocked stage gets going
    assert isinstance(info.value, PipelineError)
    assert info.value.__notes__ == [
        "giantpipe: stage 1 (device cpu) failed on micro-batch 0 (forward)"
    ]
    slow.block = False
    slow.release.set()
    step(pipe, "train_step")  # waits for the blocked thread to end its action, then runs


def test_ctrl_c_during_a_step_does_not_wait_for_a_slow_stage(released: list[Slow]) -> None:
    slow = Slow(block=True)
    released.append(slow)
    pipe = GPipe(nn.Sequential(slow, nn.Linear(8, 1)), [1, 1], devices=["cpu"] * 2, chunks=2)
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()

    def interrupt() -> None:  # Ctrl-C, once the step is blocked in stage 0
        if slow.entered.wait(30):
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    # Python's own Ctrl-C handler, as a user's process has it (a test runner's worker may have
    # replaced it with its own).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            step(pipe, "train_step")
        assert time.monotonic() - start < 5  # stage 0 stays blocked for 30 s
    finally:
        signal.signal(signal.SIGINT, previous)
    slow.block = False
    slow.release.set()
    step(pipe, "train_step")


def test_a_thread_stuck_in_a_failed_step_is_named_by_the_next_step(released: list[Slow]) -> None:
    slow = Slow(block=True)
    released.append(slow)
    pipe = GPipe(nn.Sequential(slow, nn.Linear(8, 1)), [1, 1], devices=["cpu"] * 2, timeout=0.5)
    with pytest.raises(PipelineTimeout, match="waited 0.5s"):
        step(pipe, "train_step")
    with pytest.raises(PipelineTimeout, match="giantpipe-worker-0 still ran an action of a failed"):
        step(pipe, "train_step")
    slow.block = False
    slow.release.set()
    step(pipe, "train_step")  # fresh threads


def test_mailbox_times_out_with_a_message() -> None:
    box = Mailbox(timeout=0.05)
    with pytest.raises(PipelineTimeout, match="gradient of micro-batch 3 into stage 1"):
        box.get(("grad", 1, 3))
