"""Schedules are data: exact tables, and a validator that catches broken ones."""

import pytest

from giantpipe.engine.schedules import build_schedule
from giantpipe.engine.schedules.actions import Action, Schedule, format_schedule, validate
from giantpipe.engine.schedules.fill_drain import clock_cycles, expected_bubble, fill_drain


def table(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in worker] for worker in schedule.actions]


def test_gpipe_k3_m4_exact_table() -> None:
    assert table(fill_drain(3, 4)) == [
        ["F0@0", "F1@0", "F2@0", "F3@0", "B3@0", "B2@0", "B1@0", "B0@0"],
        ["F0@1", "F1@1", "F2@1", "F3@1", "B3@1", "B2@1", "B1@1", "B0@1"],
        ["F0@2", "F1@2", "F2@2", "F3@2", "B3@2", "B2@2", "B1@2", "B0@2"],
    ]


def test_gpipe_single_stage_single_chunk() -> None:
    assert table(fill_drain(1, 1)) == [["F0@0", "B0@0"]]


def test_clock_cycles_k3_m2() -> None:
    assert clock_cycles(3, 2) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(1, 1), (0, 2)],
        [(1, 2)],
    ]


def test_phases_split_forward_and_backward() -> None:
    s = fill_drain(2, 2)
    assert s.is_fill_drain()
    assert table(s.phase("F")) == [["F0@0", "F1@0"], ["F0@1", "F1@1"]]
    assert table(s.phase("B")) == [["B1@0", "B0@0"], ["B1@1", "B0@1"]]


@pytest.mark.parametrize(
    ("k", "m", "bubble"),
    [(1, 1, 0.0), (2, 1, 0.5), (4, 4, 3 / 7), (4, 32, 3 / 35), (8, 32, 7 / 39)],
)
def test_expected_bubble(k: int, m: int, bubble: float) -> None:
    assert expected_bubble(k, m) == pytest.approx(bubble)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
def test_gpipe_validates(k: int, m: int) -> None:
    validate(build_schedule("gpipe", k, m))


def _custom(actions: list[list[Action]], k: int = 2, m: int = 1) -> Schedule:
    return Schedule("custom", k, m, tuple(tuple(w) for w in actions), tuple(range(k)))


def test_validator_rejects_deadlock() -> None:
    # Stage 0 wants its backward before the forward that feeds stage 1: nobody can move.
    bad = _custom([[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]])
    with pytest.raises(ValueError, match="deadlocks; waiting: B0@0, F0@1"):
        validate(bad)


def test_validator_rejects_missing_and_duplicate_actions() -> None:
    missing = _custom([[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 1, 0)]])
    with pytest.raises(ValueError, match="never runs"):
        validate(missing)
    dup = _custom(
        [
            [Action("F", 0, 0), Action("F", 0, 0), Action("B", 0, 0)],
            [Action("F", 1, 0), Action("B", 1, 0)],
        ]
    )
    with pytest.raises(ValueError, match="more than once"):
        validate(dup)


def test_unknown_schedule_name() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        build_schedule("zigzag", 2, 2)


def test_format_schedule() -> None:
    assert format_schedule(fill_drain(2, 1)) == "worker 0 | F0@0 B0@0\nworker 1 | F0@1 B0@1"
