"""Issue 32's exception script, and a driver that runs it many times in forked processes.

The script: a stage of a GPipe raises ValueError, then torch.OutOfMemoryError; both are caught
("kept") and the script ends. Stage 0 stays in its action (torch ops, taking the GIL back after
each) for :data:`AFTER` seconds after stage 1 raised the second time, so when the script ends a
failed step's worker thread is always inside its action: what crashed the interpreter at exit
once in 13 runs of the issue's script (whose stage 0 happened to be in an action then, now and
then).

``python failing_then_exit.py RUNS`` imports torch once, then forks RUNS children (two at a
time); each runs the script and ends as a script does (the interpreter's whole finalization).
It prints one JSON list of ``[exit status, stdout, stderr]``, one per child.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from contextlib import ExitStack

import torch
from torch import nn

from giantpipe import GPipe

AFTER = 0.3
"""Seconds stage 0 stays in its action after stage 1 raised: longer than the script takes to
end and the interpreter to start finalizing."""


class Boom(nn.Module):
    """Raises ``exc`` when set, after setting the step's ``deadline`` ``after`` seconds on."""

    def __init__(self) -> None:
        super().__init__()
        self.exc: BaseException | None = None
        self.after = AFTER
        self.deadline = [0.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exc is not None:
            self.deadline[0] = time.perf_counter() + self.after
            raise self.exc
        return x


class Busy(nn.Module):
    """Passes micro-batch 0 through; from the next, multiplies matrices until its step's
    ``deadline`` (at most 10 s): a thread mostly inside a torch op, without the GIL (so the main
    thread goes on at full speed), taking it back after each."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.deadline = [0.0]
        self.square = torch.randn(192, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        deadline, give_up = self.deadline, time.perf_counter() + 10.0  # this step's
        while self.calls > 1 and time.perf_counter() < min(deadline[0], give_up):
            torch.mm(self.square, self.square)
        return x


def script() -> None:
    """The exception script: one good step, then two failed ones, both caught. Only the last
    keeps stage 0 busy after it raised: the one whose thread is in its action at exit (the
    first's would only be joined by the next step, burning CPU meanwhile)."""
    torch.manual_seed(0)
    busy, boom = Busy(), Boom()
    model = nn.Sequential(nn.Linear(8, 8), busy, boom, nn.Linear(8, 1))
    pipe = GPipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    pipe.train_step(x, y, nn.functional.mse_loss)
    oom = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    for exc, after in ((ValueError("bad"), 0.0), (oom, AFTER)):
        busy.calls, boom.exc, boom.after = 0, exc, after
        busy.deadline = boom.deadline = [math.inf]  # set when stage 1 raises
        try:
            pipe.train_step(x, y, nn.functional.mse_loss)
        except (ValueError, torch.OutOfMemoryError):
            print("kept")


def warm_up() -> None:
    """One step of a pipe closed at once: torch's first-call set-up is then done before the
    forks, and no thread is left to be copied into them."""
    torch.set_num_threads(1)
    pipe = GPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), [1, 1], devices=["cpu"] * 2)
    pipe.train_step(torch.randn(4, 8), torch.randn(4, 1), nn.functional.mse_loss)
    pipe.close()


def run_forked(runs: int, at_once: int = 2) -> list[tuple[int, str, str]] | None:
    """Runs :func:`script` in ``runs`` forked children, ``at_once`` at a time; returns each
    one's exit status, stdout and stderr (None in a child, which then ends as the script
    would)."""
    warm_up()
    results: list[tuple[int, str, str]] = []
    while len(results) < runs:
        with ExitStack() as files:
            children = []
            for _ in range(min(at_once, runs - len(results))):
                out, err = (files.enter_context(tempfile.TemporaryFile()) for _ in range(2))
                pid = os.fork()
                if pid == 0:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    script()
                    return None
                children.append((pid, out, err))
            for pid, out, err in children:
                _, status = os.waitpid(pid, 0)
                texts = []
                for file in (out, err):
                    file.seek(0)
                    texts.append(file.read().decode(errors="replace"))
                results.append((os.waitstatus_to_exitcode(status), *texts))
    return results


if __name__ == "__main__":
    found = run_forked(int(sys.argv[1]))
    if found is not None:  # the driver; a child falls off the end like the script
        sys.stdout.write(json.dumps(found) + "\n")
