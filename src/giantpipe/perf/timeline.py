"""Drawing a step, simulated or as the executor ran it: as text, a PNG, or a Perfetto trace.

One row per worker, one box per action (F blue, B green, W orange, a recompute hatched);
:func:`plot_measured` draws ``pipe.last_timings`` the same way and :func:`write_trace` writes
both as one Chrome / Perfetto trace.

Example::

    >>> from giantpipe.engine.schedules.one_f_one_b import one_f_one_b
    >>> from giantpipe.perf.simulate import StageCost, simulate
    >>> sim = simulate(one_f_one_b(2, 3), [StageCost(forward=1.0, backward=1.0)] * 2)
    >>> print(render_text(sim))
    worker 0 | F0 F1 .  B0 F2 B1 .  B2
    worker 1 | .  F0 B0 F1 B1 F2 B2 .
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from giantpipe.engine.schedules.actions import Schedule
from giantpipe.engine.stats import ActionTiming
from giantpipe.perf.simulate import Simulation, TimedAction

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}


def render_text(sim: Simulation, tick: float | None = None) -> str:
    """The timeline on a grid of ``tick`` seconds (default: the shortest action), one cell per
    tick; an action longer than a tick fills its first cell and leaves the rest as ``--``."""
    if tick is None:
        tick = min(t.end - t.start for t in sim.timeline if t.end > t.start)
    cells = round(sim.step_time / tick)
    rows = [["."] * cells for _ in range(sim.schedule.num_workers)]
    origin = min(t.start for t in sim.timeline)
    for t in sim.timeline:
        first, last = round((t.start - origin) / tick), round((t.end - origin) / tick)
        rows[t.worker][first] = f"{t.action.kind}{t.action.microbatch}"
        for i in range(first + 1, last):
            rows[t.worker][i] = "--"
    return "\n".join(
        f"worker {w} | " + " ".join(c.ljust(2) for c in row).rstrip() for w, row in enumerate(rows)
    )


def plot_timeline(sim: Simulation, path: str | Path, title: str | None = None) -> Path:
    """Writes the simulated timeline as a PNG at ``path`` and returns the path."""
    title = title or f"{sim.schedule.name}: step {sim.step_time:.3g}s, bubble {sim.bubble:.1%}"
    return _draw(sim.schedule, sim.timeline, sim.step_time, title, path)


def plot_measured(
    timings: Sequence[ActionTiming], schedule: Schedule, path: str | Path, title: str | None = None
) -> Path:
    """Writes the timeline of a step as the executor ran it (``pipe.last_timings``) as a PNG at
    ``path`` and returns the path."""
    timeline = measured_timeline(timings, schedule.placement)
    span = max(t.end for t in timeline)
    busy = sum(t.busy for t in timeline)
    bubble = 1 - busy / (schedule.num_workers * span) if span > 0 else 0.0
    title = title or f"{schedule.name}, measured: step {span:.3g}s, bubble {bubble:.1%}"
    return _draw(schedule, timeline, span, title, path)


def measured_timeline(
    timings: Sequence[ActionTiming], placement: Sequence[int]
) -> list[TimedAction]:
    """The executor's timings as the simulator's timeline, the first start at 0. The two agree
    on what a box is: an F waits first and works last; a re-materialized B recomputes first,
    then waits for its gradient, then works; so the work ends at ``end`` in both.

    >>> from giantpipe.engine.schedules.actions import Action
    >>> t = ActionTiming(Action("B", 1, 0), start=5.0, end=9.0, waited=1.0, recompute=0.5)
    >>> [(a.worker, a.start, a.end, a.busy, a.recompute) for a in measured_timeline([t], [0, 1])]
    [(1, 0.0, 4.0, 3.0, 0.5)]
    """
    if not timings:
        return []
    origin = min(t.start for t in timings)
    return [
        TimedAction(
            t.action,
            placement[t.action.stage],
            t.start - origin,
            t.end - origin,
            t.work,
            t.recompute,
        )
        for t in sorted(timings, key=lambda t: t.start)
    ]


def _draw(
    schedule: Schedule,
    timeline: Sequence[TimedAction],
    span: float,
    title: str,
    path: str | Path,
) -> Path:
    import matplotlib  # imported here: the engine itself needs only torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    k = schedule.num_workers
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, len(timeline) / k * 0.35)), 0.6 * k + 1.4))
    for t in timeline:
        kind, m = t.action.kind, t.action.microbatch
        work_start = t.end - (t.busy - t.recompute)
        if t.recompute:
            ax.barh(t.worker, t.recompute, left=t.start, color="0.8", hatch="//", edgecolor="0.5")
        ax.barh(
            t.worker, t.end - work_start, left=work_start, color=COLORS[kind], edgecolor="white"
        )
        label = f"{kind}{m}" if schedule.virtual_stages == 1 else f"{kind}{m}.{t.action.stage}"
        inches = (t.end - work_start) / span * fig.get_size_inches()[0] * 0.85
        if inches > 0.075 * len(label):  # label only the boxes it fits in
            ax.text(
                (work_start + t.end) / 2,
                t.worker,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(k), [f"worker {w}" for w in range(k)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    legend = [Patch(color=c, label=n) for n, c in COLORS.items()]
    legend.append(Patch(facecolor="0.8", hatch="//", label="recompute"))
    ax.legend(
        handles=legend, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False
    )
    ax.set_title(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---- Chrome / Perfetto traces ------------------------------------------------------------------

_WORK = {"F": "forward", "B": "backward", "W": "weight"}


def write_trace(
    path: str | Path,
    timings: Sequence[Sequence[ActionTiming]],
    simulation: Simulation | None = None,
) -> Path:
    """Writes a step as a Chrome trace (JSON: open it in https://ui.perfetto.dev or
    chrome://tracing) at ``path`` and returns the path.

    ``timings`` holds one list per rank (one process: ``[pipe.last_timings]``): each rank is a
    process of the trace (``measured, rank r``), each stage a track (``stage s``), each action a
    slice (``F3``) holding its parts in the order the simulator draws them: ``recompute`` (a
    re-materialized B), ``wait`` (for the neighbour's activation or gradient), then the work
    (``forward``, ``backward``, ``weight``); ``receive`` marks the value's arrival, ``send`` its
    hand-off, with an arrow between the two. ``simulation`` adds the simulated step as a process
    of its own (``simulated``), on the same tracks. Each rank's clock starts at its first action
    (the ranks' clocks are not one clock).

    >>> from giantpipe.engine.schedules.actions import Action
    >>> path = write_trace("/tmp/t.json", [[ActionTiming(Action("F", 0, 0), 0.0, 0.5)]])
    >>> sorted({e["name"] for e in json.loads(path.read_text())["traceEvents"]})
    ['F0', 'forward', 'process_name', 'thread_name', 'thread_sort_index']
    """
    processes = [
        (f"measured, rank {r}" if len(timings) > 1 else "measured", _timed(t))
        for r, t in enumerate(timings)
    ]
    if simulation is not None:
        processes.append(("simulated", list(simulation.timeline)))
    stages = 1 + max((t.action.stage for _, line in processes for t in line), default=0)
    events: list[dict[str, Any]] = []
    for pid, (name, timeline) in enumerate(processes):
        events += _process_events(pid, name, timeline, stages)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


def _timed(timings: Sequence[ActionTiming]) -> list[TimedAction]:
    stages = 1 + max((t.action.stage for t in timings), default=0)
    return measured_timeline(timings, list(range(stages)))


def _process_events(
    pid: int, name: str, timeline: Sequence[TimedAction], stages: int
) -> list[dict[str, Any]]:
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}]
    for s in sorted({t.action.stage for t in timeline}):
        track = {"ph": "M", "pid": pid, "tid": s}
        events.append({**track, "name": "thread_name", "args": {"name": f"stage {s}"}})
        events.append({**track, "name": "thread_sort_index", "args": {"sort_index": s}})
    for t in timeline:
        events += _action_events(pid, t, stages)
    return events


def _action_events(pid: int, t: TimedAction, stages: int) -> list[dict[str, Any]]:
    """The action's slice, its parts (each within the slice) and its receive / send."""
    kind, s, m = t.action.kind, t.action.stage, t.action.microbatch
    work = _WORK.get(kind, kind)
    waited = max(0.0, (t.end - t.start) - t.busy)
    parts = [("recompute", t.recompute), ("wait", waited), (work, 0.0)]
    points = [_us(t.start)]  # where each part starts; the work ends the action
    for _, seconds in parts[:-1]:
        points.append(min(_us(t.end), points[-1] + _us(seconds)))
    points.append(_us(t.end))
    track = {"pid": pid, "tid": s}
    args = {"stage": s, "microbatch": m, "kind": work}
    events = [_slice(track, f"{kind}{m}", "action", points[0], points[-1], args)]
    for (part, _), start, end in zip(parts, points, points[1:]):
        if end > start or part == work:
            events.append(_slice(track, part, part, start, end))
    what = "activation" if kind == "F" else "gradient"
    source = {"F": s - 1, "B": s + 1}.get(kind, -1)
    if 0 <= source < stages:  # the value came from a neighbour
        flow = _flow(pid, kind, m, s)
        events.append(_mark(track, "receive", points[2], {"from stage": source, "value": what}))
        events.append({**_arrow(track, "f", what, flow, points[2]), "bp": "e"})
    target = {"F": s + 1, "B": s - 1}.get(kind, -1)
    if 0 <= target < stages:  # ... and goes on to the next
        flow = _flow(pid, kind, m, target)
        events.append(_mark(track, "send", points[-1], {"to stage": target, "value": what}))
        events.append(_arrow(track, "s", what, flow, points[-1]))
    return events


def _slice(
    track: dict[str, int], name: str, cat: str, start: float, end: float, args: Any = None
) -> dict[str, Any]:
    event = {**track, "ph": "X", "name": name, "cat": cat, "ts": start, "dur": end - start}
    return event if args is None else {**event, "args": args}


def _mark(track: dict[str, int], name: str, ts: float, args: dict[str, Any]) -> dict[str, Any]:
    return {**track, "ph": "i", "s": "t", "name": name, "cat": name, "ts": ts, "args": args}


def _arrow(track: dict[str, int], ph: str, name: str, flow: int, ts: float) -> dict[str, Any]:
    """One end of the arrow from a send to its receive (``ph`` "s": start, "f": finish)."""
    return {**track, "ph": ph, "name": name, "cat": "flow", "id": flow, "ts": ts}


def _flow(pid: int, kind: str, m: int, receiver: int) -> int:
    # one arrow per value handed on: (process, kind, micro-batch, receiving stage)
    return ((pid * 4 + "FBW".index(kind)) * 1_000_003 + m) * 10_007 + receiver


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)
