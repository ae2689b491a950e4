"""Stage costs of a distributed forecast from the executor's timings of a real step: exact."""

from __future__ import annotations

from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.actions import Action
from giantpipe.engine.stats import ActionTiming
from giantpipe.perf.measured import stage_cost, stage_costs
from giantpipe.perf.simulate import StageCost, simulate


def timing(kind: str, stage: int, m: int, work: float, waited: float = 0.0, **more) -> ActionTiming:
    # Times in binary fractions, so that end - start - waited is exact.
    return ActionTiming(Action(kind, stage, m), 16.0, 16.0 + work + waited, waited, **more)


def test_kept_and_rematerialized_microbatches_make_their_own_costs() -> None:
    # M=3, except_last: m=0,1 re-materialized (F without grad, recompute in B), m=2 kept.
    timings = [
        timing("F", 1, 0, 1.0, waited=4.0, received=400, kept=400),
        timing("F", 1, 1, 1.5, received=400, kept=400),
        timing("F", 1, 2, 2.0, received=400, kept=1400),
        timing("B", 1, 0, 4.0, recompute=1.5, kept=1000),
        timing("B", 1, 1, 4.5, recompute=1.75, kept=1000),
        timing("B", 1, 2, 3.0),
    ]
    cost = stage_cost(timings, stop=2, send=0.25, static_bytes=64, first=False)
    assert cost == StageCost(
        forward=2.0,
        backward=2.75,  # median of 4.0-1.5, 4.5-1.75, 3.0: the recompute is left out
        forward_no_grad=1.25,
        recompute=1.625,
        send=0.25,
        input_bytes=400,
        activation_bytes=1000,
        static_bytes=64,
    )


def test_split_backward_and_stage_zero_bytes() -> None:
    # zb-h1 style: every B has a W; stage 0 never re-materializes (never): input unknown -> 0.
    timings = [timing("F", 0, 0, 1.0, kept=900), timing("B", 0, 0, 0.5), timing("W", 0, 0, 0.25)]
    cost = stage_cost(timings, stop=0, send=0.0, static_bytes=0, first=True)
    assert (cost.backward_input, cost.weight, cost.backward) == (0.5, 0.25, 0.75)
    assert (cost.input_bytes, cost.activation_bytes) == (0, 900)


def test_the_simulated_step_of_measured_costs() -> None:
    schedule = build_schedule("gpipe", 2, 2)
    timings = [
        timing(kind, s, m, 1.0 if kind == "F" else 2.0)
        for s in (0, 1)
        for kind in "FB"
        for m in (0, 1)
    ]
    costs = stage_costs(timings, 2, stop=0, sends=[0.5, 0.0], static_bytes=[0, 0])
    sim = simulate(schedule, costs, "never")
    # stage 1: F10 once F00 (1) and its crossing (0.5) are done, F11, B11, B10 (ends 7.5);
    # stage 0: B00 once B10 and the gradient's crossing are done, ending at 10
    assert sim.step_time == 1.0 + 0.5 + 1.0 + 1.0 + 2.0 + 2.0 + 0.5 + 2.0
