"""The 1F1B family: 1F1B with flush, interleaved 1F1B and the zero-bubble ZB-H1 and ZB-V.

All keep GPipe's synchronous update (one flush per mini-batch), so they are transparent: only
the order of the actions changes, and with it memory and idle time (each order pictured:
docs/engine-internals.md#the-1f1b-family).

Example::

    >>> [str(a) for a in one_f_one_b(2, 3).actions[0]]
    ['F0@0', 'F1@0', 'B0@0', 'F2@0', 'B1@0', 'B2@0']
"""

from __future__ import annotations

from giantpipe.engine.schedules.actions import Action, Schedule, _check_sizes, dependencies


def one_f_one_b(num_workers: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """1F1B with flush: K-k-1 warm-up forwards on stage k, then F and B alternate.

    >>> [str(a) for a in one_f_one_b(2, 2).actions[1]]
    ['F0@1', 'B0@1', 'F1@1', 'B1@1']
    """
    _check_single_stage("1f1b", num_workers, chunks, virtual_stages)
    workers = []
    for k in range(num_workers):
        forwards = [Action("F", k, m) for m in range(chunks)]
        backwards = [Action("B", k, m) for m in range(chunks)]
        workers.append(_one_f_one_b_order(forwards, backwards, warmup=num_workers - k - 1))
    return Schedule("1f1b", num_workers, chunks, tuple(workers), _identity(num_workers))


def _one_f_one_b_order(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> tuple[Action, ...]:
    """Warm-up forwards, then one forward and one backward in turn, then the remaining
    backwards. ``forwards`` and ``backwards`` are one worker's actions in the order they run."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    order += backwards[len(forwards) - warmup :]
    return tuple(order)


def interleaved(num_workers: int, chunks: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's order): K*V stages, stage s on worker s % K.

    A worker's forwards go round its V stages in groups of K micro-batches (depth first: stage
    w for micro-batches 0..K-1, then stage w+K for the same ones, ...); its backwards go round
    the stages in reverse. Worker w warms up with 2(K-w-1) + (V-1)K forwards.

    >>> [str(a) for a in interleaved(2, 2, 2).actions[1]]
    ['F0@1', 'F1@1', 'F0@3', 'B0@3', 'F1@3', 'B1@3', 'B0@1', 'B1@1']
    """
    k, v = num_workers, virtual_stages
    _check_sizes(k, chunks, v)
    if v < 2:
        raise ValueError(
            f"interleaved needs virtual_stages >= 2 (got {v}); with one stage per worker use '1f1b'"
        )
    if chunks % k:
        raise ValueError(
            "interleaved 1F1B needs the number of micro-batches "
            f"(chunks={chunks}) to be a multiple of the number of workers ({k}): micro-batches "
            "go round the stages in groups of K"
        )
    total = chunks * v

    def action(kind: str, w: int, i: int) -> Action:
        chunk = (i % (k * v)) // k
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, chunk * k + w, (i // (k * v)) * k + i % k)

    workers = []
    for w in range(k):
        forwards = [action("F", w, i) for i in range(total)]
        backwards = [action("B", w, i) for i in range(total)]
        warmup = 2 * (k - w - 1) + (v - 1) * k
        workers.append(_one_f_one_b_order(forwards, backwards, warmup))
    placement = tuple(s % k for s in range(k * v))
    return Schedule("interleaved", k * v, chunks, tuple(workers), placement)


def zb_h1(num_workers: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1: 1F1B with the backward split into B and W; stage k defers its first k W.

    After each B, the stage runs the oldest pending W once it has done more than k backwards;
    the W still pending after the last B run at the end, where stage k would otherwise wait
    for the drain.

    >>> [str(a) for a in zb_h1(2, 2).actions[1]]
    ['F0@1', 'B0@1', 'F1@1', 'B1@1', 'W0@1', 'W1@1']
    """
    _check_single_stage("zb-h1", num_workers, chunks, virtual_stages)
    workers = []
    for k in range(num_workers):
        forwards = [Action("F", k, m) for m in range(chunks)]
        backwards = [Action("B", k, m) for m in range(chunks)]
        order = _one_f_one_b_order(forwards, backwards, warmup=num_workers - k - 1)
        workers.append(_with_weight_gradients(order, deferred=k))
    return Schedule("zb-h1", num_workers, chunks, tuple(workers), _identity(num_workers))


def _with_weight_gradients(order: tuple[Action, ...], deferred: int) -> tuple[Action, ...]:
    """Inserts W(m) after the B that leaves more than ``deferred`` weight gradients pending,
    oldest first; the rest go at the end."""
    out: list[Action] = []
    pending: list[Action] = []
    for a in order:
        out.append(a)
        if a.kind == "B":
            pending.append(Action("W", a.stage, a.microbatch))
            if len(pending) > deferred:
                out.append(pending.pop(0))
    return tuple(out + pending)


def zb_v(num_workers: int, chunks: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V: 2K half stages in a V (worker w: stages w and 2K-1-w), B and W split, ordered by
    a list schedule on unit costs (docs/engine-internals.md#the-1f1b-family).

    >>> s = zb_v(2, 2)
    >>> s.placement
    (0, 1, 1, 0)
    >>> [str(a) for a in s.actions[0]][:5]    # 3 activations held (< 2K): F1@3 before W0@3
    ['F0@0', 'F1@0', 'F0@3', 'B0@3', 'F1@3']
    """
    k, v = num_workers, virtual_stages
    _check_sizes(k, chunks, v)
    if v != 2:
        raise ValueError(f"zb-v runs 2 stages per worker (virtual_stages=2, got {v})")
    n = 2 * k
    placement = tuple(s if s < k else n - 1 - s for s in range(n))
    orders = _list_schedule(placement, chunks, held_limit=2 * k)
    return Schedule("zb-v", n, chunks, tuple(tuple(o) for o in orders), placement)


def _list_schedule(placement: tuple[int, ...], chunks: int, held_limit: int) -> list[list[Action]]:
    """Simulates unit-cost actions tick by tick: a free worker takes its ready B (oldest
    micro-batch, later stage first), else a ready F (later stage first, then oldest) while it
    holds fewer than ``held_limit`` activations (from F to W), else its oldest W."""
    n, k = len(placement), max(placement) + 1
    # Each kind runs on each stage in micro-batch order (by induction on the dependencies), so
    # only the next micro-batch of each (kind, stage) can be the oldest ready one: checking
    # those alone gives the same order in O(stages) per tick, not O(M) (the planner builds
    # ZB-V for M up to the batch size).
    nxt = {(kind, s): 0 for s in range(n) for kind in "FBW"}
    stages = [[s for s in range(n) if placement[s] == w] for w in range(k)]
    left = [3 * chunks * len(own) for own in stages]
    finished: dict[Action, int] = {}
    free, held = [0] * k, [0] * k
    orders: list[list[Action]] = [[] for _ in range(k)]
    tick = 0
    while any(left):
        for w in range(k):
            if free[w] > tick or not left[w]:
                continue
            heads = [Action(kind, s, nxt[kind, s]) for s in stages[w] for kind in "FBW"]
            ready = [
                a for a in heads
                if a.microbatch < chunks
                and all(finished.get(d, tick + 1) <= tick for d in dependencies(a, n))
            ]  # fmt: skip
            action = _pick(ready, allow_forward=held[w] < held_limit)
            if action is None:
                continue
            nxt[action.kind, action.stage] += 1
            left[w] -= 1
            orders[w].append(action)
            held[w] += {"F": 1, "W": -1}.get(action.kind, 0)
            free[w] = finished[action] = tick + 1
        tick += 1
    return orders


def _pick(ready: list[Action], allow_forward: bool) -> Action | None:
    by_kind = {kind: [a for a in ready if a.kind == kind] for kind in "FBW"}
    if by_kind["B"]:
        return min(by_kind["B"], key=lambda a: (a.microbatch, -a.stage))
    if by_kind["F"] and allow_forward:
        return min(by_kind["F"], key=lambda a: (-a.stage, a.microbatch))
    if by_kind["W"]:
        return min(by_kind["W"], key=lambda a: (a.microbatch, -a.stage))
    return None


def _check_single_stage(name: str, k: int, chunks: int, v: int) -> None:
    _check_sizes(k, chunks, v)
    if v != 1:
        raise ValueError(
            f"{name} runs one stage per worker (virtual_stages=1, got {v}); "
            "use 'interleaved' for virtual stages"
        )


def _identity(num_workers: int) -> tuple[int, ...]:
    return tuple(range(num_workers))
