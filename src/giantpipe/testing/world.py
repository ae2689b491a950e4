"""A world of ranks on this machine: a free loopback port and each rank's torchrun environment.

Tests and benchmarks start a small world themselves (spawned processes over gloo, or NCCL ranks
one per GPU) instead of under torchrun: each process then sets what torchrun would have set for
it, on a port no one listens on.

Example::

    port = free_port()                                    # once, in the launching process
    os.environ.update(rank_env(rank, world=2, port=port))  # in each rank, before joining
    torch.distributed.init_process_group("gloo")
"""

from __future__ import annotations

import os
import random
import socket

PORTS = range(20000, 32000)
"""Rendezvous ports: below the kernel's ephemeral range (32768-60999 by default), which gloo's
own connections draw from, so no process is handed one of these between our pick and our bind;
each pytest-xdist worker draws from its own slice, so two workers never pick the same."""

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A loopback port no one listens on, from this test worker's slice of :data:`PORTS` (the
    whole range outside pytest-xdist).

    >>> port = free_port()
    >>> port in PORTS
    True
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    size = len(PORTS) // max(count, 1)
    mine = range(PORTS.start + index * size, PORTS.start + (index + 1) * size)
    for port in random.sample(mine, k=min(200, len(mine))):
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {mine}")


def rank_env(rank: int, world: int, port: int, local_rank: int | None = None) -> dict[str, str]:
    """What torchrun sets for rank ``rank`` of a ``world`` on this machine, meeting on loopback
    ``port`` (``LOCAL_RANK``: the rank itself, one machine, unless given).

    >>> env = rank_env(1, 2, 29500)
    >>> env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]
    ('127.0.0.1', '29500', '1', '2', '1')
    """
    return {
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
    }
