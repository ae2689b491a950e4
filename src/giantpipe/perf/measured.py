"""The forecast of a distributed step, from the executor's own timings of one real step.

A torchrun rank holds only its own stages, so instead of replaying a step (:mod:`.predict`) the
forecast takes every rank's timed actions (:func:`stage_costs`) and each boundary's probed
crossing time (:func:`probe_link`), and the simulator adds the waiting. Which timing gives which
cost: docs/performance.md#forecasting-a-distributed-step.

Example (rank 0, after a step on every rank)::

    costs = stage_costs(all_timings, schedule.num_stages, stop, sends, static)
    sim = simulate(schedule, costs, "except_last")
    sim.step_time, sim.bubble
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from giantpipe.engine.distributed.faults import wait_device
from giantpipe.engine.stats import ActionTiming
from giantpipe.perf.simulate import StageCost


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def stage_cost(
    timings: Sequence[ActionTiming], stop: int, send: float, static_bytes: int, first: bool
) -> StageCost:
    """One stage's cost from the timings of its actions in one step (which timing gives which
    cost: docs/performance.md#forecasting-a-distributed-step).

    Example::

        stage_cost(pipe.last_timings, stop=3, send=0.002, static_bytes=4096, first=True)
    """
    split = {t.action.microbatch for t in timings if t.action.kind == "W"}

    def pick(kind: str, keep: Callable[[int], bool], value: Callable[[ActionTiming], float]):
        return _median(
            [value(t) for t in timings if t.action.kind == kind and keep(t.action.microbatch)]
        )

    work = lambda t: t.work  # noqa: E731
    forward = pick("F", lambda m: m >= stop, work)
    no_grad = pick("F", lambda m: m < stop, work)
    fields: dict[str, Any] = {
        "forward": forward if forward is not None else no_grad or 0.0,
        "backward": pick("B", lambda m: m not in split, lambda t: t.work - t.recompute) or 0.0,
    }
    optional = {
        "forward_no_grad": no_grad,
        "backward_input": pick("B", lambda m: m in split, lambda t: t.work - t.recompute),
        "weight": pick("W", lambda m: True, work),
        "recompute": pick("B", lambda m: m < stop, lambda t: t.recompute),
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    if "backward_input" in fields and not any(
        t.action.kind == "B" and t.action.microbatch not in split for t in timings
    ):
        fields["backward"] = fields["backward_input"] + fields.get("weight", 0.0)
    inputs, activations = _bytes(timings, stop, first)
    return StageCost(
        **fields,
        send=send,
        input_bytes=inputs,
        activation_bytes=activations,
        static_bytes=static_bytes,
    )


def _bytes(timings: Sequence[ActionTiming], stop: int, first: bool) -> tuple[int, int]:
    """(input bytes, activation bytes) of one micro-batch of the stage."""
    forwards = [t for t in timings if t.action.kind == "F"]
    received = _median([t.received for t in forwards])
    inputs = int(received or 0)
    if first:  # stage 0 receives nothing: its input is what a re-materialized F kept
        inputs = int(_median([t.kept for t in forwards if t.action.microbatch < stop]) or 0)
    recomputed = _median([t.kept for t in timings if t.action.kind == "B" and t.kept])
    kept = _median([t.kept for t in forwards if t.action.microbatch >= stop])
    if recomputed is not None:
        return inputs, int(recomputed)
    return inputs, max(0, int(kept or 0) - inputs)


def stage_costs(
    timings: Sequence[ActionTiming],
    num_stages: int,
    stop: int,
    sends: Sequence[float],
    static_bytes: Sequence[int],
) -> list[StageCost]:
    """Every stage's cost from the timings of every rank's actions in one step."""
    return [
        stage_cost(
            [t for t in timings if t.action.stage == s], stop, sends[s], static_bytes[s], s == 0
        )
        for s in range(num_stages)
    ]


def probe_link(
    group: Any,
    sender: int,
    receiver: int,
    nbytes: int,
    rank: int,
    device: torch.device | str,
    repeats: int = 5,
    timeout: float = 60.0,
) -> float:
    """Collective over ``group`` (every rank calls it; only ``sender`` and ``receiver`` work):
    seconds for a value of ``nbytes`` to go from ``sender`` to ``receiver`` as the transport
    sends it in the steady state (one message: its bytes alone), half the median of
    ``repeats`` round trips.

    The link is what boundary payloads cross: ``group`` is the pipe's ``groups.p2p`` and
    ``device`` where its payloads live (``comm_device(pipe.device)``: the GPU under NCCL, so
    the time includes NCCL's kernels; host memory under gloo). A CUDA round trip is timed to
    its end on the device, waited for at most ``timeout`` seconds (a dead peer raises
    RankFailure rather than hanging the probe).

    Example::

        device = comm_device(pipe.device)
        seconds = probe_link(pipe.groups.p2p, 0, 1, 4 * 64 * 1024, dist.get_rank(), device)
    """
    if rank not in (sender, receiver) or sender == receiver:
        return 0.0
    device = torch.device(device)
    peer = receiver if rank == sender else sender
    message = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    order = (dist.send, dist.recv) if rank == sender else (dist.recv, dist.send)
    trips = []
    for _ in range(repeats + 1):  # the first round trip opens the connection
        start = time.perf_counter()
        for op in order:
            op(message, peer, group=group)
        if device.type == "cuda":  # NCCL's send and recv return once enqueued
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            wait_device(event, timeout, f"a link probe with rank {peer}", None)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips[1:]) / 2
