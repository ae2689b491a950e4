"""GPipe's fill-drain: all forwards, then all backwards; its bubble and its clock ticks.

Its registry name is ``"gpipe"`` (:func:`~giantpipe.engine.schedules.build_schedule`); the
legend of :mod:`.actions` draws it for K=3, M=4.

Example::

    >>> [str(a) for a in fill_drain(num_workers=2, chunks=2).actions[0]]
    ['F0@0', 'F1@0', 'B1@0', 'B0@0']
"""

from __future__ import annotations

import functools

from giantpipe.engine.schedules.actions import Action, Schedule, _check_sizes, validate


def expected_bubble(num_workers: int, chunks: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a fill-drain or 1F1B pipeline with equal stage costs: (K-1)/(M+K-1).

    With V virtual stages per worker (interleaved 1F1B) the fill and drain shrink V-fold:
    (K-1)/(V*M+K-1).

    >>> expected_bubble(4, 4)
    0.42857142857142855
    """
    k, v = num_workers, virtual_stages
    return (k - 1) / (v * chunks + k - 1)


def fill_drain(
    num_workers: int,
    chunks: int,
    virtual_stages: int = 1,
    placement: tuple[int, ...] | None = None,
) -> Schedule:
    """GPipe fill-drain: all forwards in micro-batch order, then all backwards in reverse.

    Backwards run last-in first-out, as autograd would for the whole mini-batch, so the last
    micro-batch (whose activations are the freshest) is released first. With ``virtual_stages``
    V > 1, the ``num_workers`` K hold K*V stages (stage s on worker s % K, or as ``placement``
    says: another schedule's stages, for its forward-only phase) and each worker runs its
    stages one after the other, breadth first ("looped" fill-drain).

    >>> [str(a) for a in fill_drain(2, 1, 2, placement=(0, 1, 1, 0)).actions[0]]
    ['F0@0', 'F0@3', 'B0@3', 'B0@0']
    """
    _check_sizes(num_workers, chunks, virtual_stages)
    k, v = num_workers, virtual_stages
    placement = tuple(s % k for s in range(k * v)) if placement is None else tuple(placement)
    workers = []
    for w in range(k):
        stages = [s for s, owner in enumerate(placement) if owner == w]
        forwards = [Action("F", s, m) for s in stages for m in range(chunks)]
        backwards = [Action("B", s, m) for s in reversed(stages) for m in reversed(range(chunks))]
        workers.append(tuple(forwards + backwards))
    return Schedule("gpipe", k * v, chunks, tuple(workers), placement)


@functools.lru_cache(maxsize=64)
def forward_schedule(
    workers: int, chunks: int, virtual_stages: int, placement: tuple[int, ...]
) -> Schedule:
    """Fill-drain over another schedule's stages, validated once per configuration: the forward
    of a pipe whatever its training schedule is (a ZB-V pipe places its stages in a V). The
    forward of torchgpipe's door (``GPipe.forward``) and of every forward without gradients,
    built for the micro-batches of the call (a short evaluation batch runs fewer than M).

    >>> forward_schedule(2, 4, 1, (0, 1)) is forward_schedule(2, 4, 1, (0, 1))
    True
    >>> [str(a) for a in forward_schedule(2, 3, 1, (0, 1)).phase("F").actions[1]]
    ['F0@1', 'F1@1', 'F2@1']
    """
    schedule = fill_drain(workers, chunks, virtual_stages, placement=placement)
    validate(schedule)
    return schedule


def clock_cycles(num_stages: int, chunks: int) -> list[list[tuple[int, int]]]:
    """Forward clock ticks of fill-drain, one stage per worker: at tick t, stage k runs
    micro-batch t - k.

    >>> clock_cycles(2, 3)
    [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]

    Each pair is (micro-batch, stage); useful to draw or reason about the pipeline's fill.
    """
    _check_sizes(num_stages, chunks)
    ticks = []
    for t in range(chunks + num_stages - 1):
        ticks.append([(t - k, k) for k in range(num_stages) if 0 <= t - k < chunks])
    return ticks
