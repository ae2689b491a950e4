"""The monitored figure's ranking and early stopping, as exact tables (Lightning's rules:
an improvement must beat the best by more than min_delta; patience counts evaluations)."""

import math

import pytest

from giantpipe.runner.early_stop import EarlyStopping
from giantpipe.runner.monitor import Monitor

LOSS, ACCURACY = Monitor("eval/loss", "min"), Monitor("eval/accuracy", "max")


@pytest.mark.parametrize(
    ("monitor", "value", "than", "by", "better"),
    [
        (LOSS, 0.4, 0.5, 0.0, True),
        (LOSS, 0.5, 0.5, 0.0, False),  # a tie is no improvement
        (LOSS, 0.45, 0.5, 0.05, False),  # by exactly min_delta: not more than it
        (LOSS, 0.44, 0.5, 0.05, True),
        (LOSS, 0.6, 0.5, 0.0, False),
        (ACCURACY, 0.6, 0.5, 0.0, True),
        (ACCURACY, 0.55, 0.5, 0.1, False),
        (ACCURACY, 0.4, 0.5, 0.0, False),
    ],
)
def test_better_is_by_more_than_min_delta_in_the_monitors_direction(
    monitor, value, than, by, better
):
    assert monitor.better(value, than, by) is better


def test_ranked_is_best_first_and_the_earlier_of_equal_scores_first():
    scores = {2: 0.5, 4: 0.3, 6: 0.5, 8: 0.7}
    assert LOSS.ranked(scores) == [4, 2, 6, 8]
    assert Monitor("eval/loss", "max").ranked(scores) == [8, 2, 6, 4]


def test_value_is_none_for_a_missing_or_non_finite_figure():
    assert LOSS.value({"eval/loss": 0.25}) == 0.25
    assert LOSS.value({"eval/accuracy": 0.25}) is None
    assert LOSS.value({"eval/loss": math.nan}) is None
    assert LOSS.value({"eval/loss": math.inf}) is None


def run(stopping: EarlyStopping, values: list[float]) -> list[str | None]:
    return [stopping.observe(10 * (i + 1), {"eval/loss": v}) for i, v in enumerate(values)]


@pytest.mark.parametrize(
    ("patience", "min_delta", "values", "stops_at", "best"),
    [
        (2, 0.0, [0.5, 0.4, 0.3, 0.2], None, None),  # always improving
        (2, 0.0, [0.5, 0.6, 0.7], 30, (10, 0.5)),
        (2, 0.0, [0.5, 0.6, 0.4, 0.45, 0.45], 50, (30, 0.4)),  # an improvement resets it
        (2, 0.0, [0.5, 0.5, 0.5], 30, (10, 0.5)),  # a tie does not improve
        (1, 0.1, [0.5, 0.45], 20, (10, 0.5)),  # better, but not by more than min_delta
        (1, 0.1, [0.5, 0.35], None, None),
        (3, 0.0, [0.5, math.nan, 0.6, 0.55], 40, (10, 0.5)),  # NaN counts as no improvement
    ],
)
def test_early_stopping_stops_after_patience_evaluations_without_improvement(
    patience, min_delta, values, stops_at, best
):
    stopping = EarlyStopping(LOSS, patience, min_delta)
    lines = run(stopping, values)
    stopped = [10 * (i + 1) for i, line in enumerate(lines) if line is not None]
    assert stopped[:1] == ([stops_at] if stops_at else [])
    if stops_at:
        assert lines[stopped[0] // 10 - 1] == (
            f"stopped early at step {stops_at}: eval/loss did not improve by {min_delta:g} for "
            f"{patience} evaluations (best {best[1]:g} at step {best[0]})"
        )


def test_replay_counts_on_from_the_earlier_evaluations():
    """A resumed run stops where the uninterrupted one would: patience is not restarted."""
    whole = EarlyStopping(LOSS, patience=3)
    expected = run(whole, [0.5, 0.6, 0.7, 0.8])
    resumed = EarlyStopping(LOSS, patience=3)
    resumed.replay({20: {"eval/loss": 0.6}, 10: {"eval/loss": 0.5}})  # any order: by step
    assert [resumed.observe(30, {"eval/loss": 0.7}), resumed.observe(40, {"eval/loss": 0.8})] == (
        expected[2:]
    )
    assert expected[3] is not None
