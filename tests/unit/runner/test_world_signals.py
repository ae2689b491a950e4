"""Issue 22, item 7: SIGHUP (a dropped SSH session) saves and stops like SIGTERM, in this
process and agreed across torchrun's ranks; ``nohup`` and ``trainer.save_signal=SIGHUP`` keep
their meaning. Signals sent to this process, no training."""

from __future__ import annotations

import os
import pty
import signal
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from giantpipe.runner import world as world_module
from giantpipe.runner.world import Request, StopSignals, TorchrunWorld, leave_lost_terminal
from tests.timeouts import scaled


@pytest.fixture
def hangups() -> Iterator[list[int]]:
    """SIGHUPs that reach no StopSignals land here instead of ending the test process."""
    caught: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: caught.append(signum))
    yield caught
    signal.signal(signal.SIGHUP, previous)


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)  # Python runs the handler before the next line


def test_sighup_stops_like_sigterm_unless_ignored_or_the_save_signal(hangups: list[int]) -> None:
    with StopSignals() as signals:
        send(signal.SIGHUP)
        assert signals.take() == Request("hangup")
        assert signals.take() == Request("hangup")  # a stop is not undone
        send(signal.SIGTERM)  # preemption wins: the cluster's status, exit 143
        assert signals.take() == Request("preempted")
    assert hangups == []
    send(signal.SIGHUP)  # uninstalled: the handler from before is back
    assert hangups == [signal.SIGHUP]

    with StopSignals("SIGHUP") as signals:  # trainer.save_signal=SIGHUP: save and go on
        send(signal.SIGHUP)
        assert signals.take() == Request(None, save=True)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does before starting the run
    with StopSignals() as signals:
        send(signal.SIGHUP)
        assert signals.take() == Request()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_the_ranks_agree_on_which_stop_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank caught SIGHUP, another Ctrl-C (torchrun passes a hang-up on to every rank, a
    terminal may reach only some): every rank stops as hung up, the same step."""
    monkeypatch.setattr(world_module, "init_distributed", lambda **kwargs: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: "<gloo>")
    world = TorchrunWorld(timeout=scaled(60.0))
    sums = {"flags": [0.0, 1.0, 1.0, 0.0]}  # preempted, hangup, interrupted, save: summed
    sent: list[list[float]] = []

    def summed(values: list[float]) -> list[float]:
        sent.append(values)
        return sums["flags"]

    monkeypatch.setattr(world, "sum", summed)
    assert world.agree_stop(Request("hangup")) == Request("hangup")
    assert sent == [[0.0, 1.0, 0.0, 0.0]]
    sums["flags"] = [1.0, 1.0, 0.0, 1.0]
    assert world.agree_stop(Request()) == Request("preempted", save=True)


def test_a_hung_up_terminal_is_swapped_for_dev_null() -> None:
    """After a hang-up a write to the terminal fails (EIO) and would fail the saved run."""
    master, slave = pty.openpty()
    try:
        assert os.isatty(slave)
        leave_lost_terminal([slave])
        assert not os.isatty(slave)
        assert os.write(slave, b"the summary table") == len(b"the summary table")
    finally:
        os.close(master)
        os.close(slave)


def test_nested_holds_keep_the_handlers_until_the_outermost_ends(hangups: list[int]) -> None:
    """Issue 32, item 1: the loop put the handlers back before the run's final evaluation and
    save, where a save signal then killed the process (SIGUSR1's default action). The run
    holds them around the loop and its record (``with loop.signals:`` twice)."""
    stray: list[int] = []  # what reaches no StopSignals (SIGUSR1 would end the test process)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: stray.append(signum))
    try:
        signals = StopSignals("SIGUSR1")
        with signals:
            with signals:
                send(signal.SIGUSR1)
            send(signal.SIGUSR1)  # after the inner block: still the run's
            send(signal.SIGHUP)
            assert signals.take() == Request("hangup", save=True)
        assert stray == [] and hangups == []
        send(signal.SIGUSR1)  # after the outer block: the handler from before is back
        assert stray == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
