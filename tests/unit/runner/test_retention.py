"""Which step_N/ a run keeps, as exact tables: the keep_last newest of checkpoint_every's, the
keep_best best by the monitored figure, and when an evaluation is saved as one of the best."""

from pathlib import Path

import pytest

from giantpipe.runner.ledger import Ledger
from giantpipe.runner.monitor import Monitor
from giantpipe.runner.retention import Retention, kept

LOSS = Monitor("eval/loss", "min")
NEWEST_2 = "among the 2 newest (trainer.keep_last)"


@pytest.mark.parametrize(
    ("written", "scores", "monitor", "keep_last", "keep_best", "expected"),
    [
        (  # the k newest of checkpoint_every's
            {2: ["every"], 4: ["every"], 6: ["every"], 8: ["every"]},
            {},
            None,
            2,
            0,
            {8: NEWEST_2, 6: NEWEST_2},
        ),
        (  # null keeps every one of them; the best-only saves are ranked
            {2: ["every"], 3: ["best"], 5: ["best"]},
            {3: 0.5, 5: 0.4},
            LOSS,
            None,
            1,
            {
                2: "written by trainer.checkpoint_every (trainer.keep_last=null keeps all)",
                5: "eval/loss 0.4, the best (trainer.keep_best=1)",
            },
        ),
        (  # a newest one that is also among the best says both
            {2: ["every"], 4: ["every", "best"]},
            {2: 0.5, 4: 0.3},
            LOSS,
            1,
            2,
            {
                4: "among the 1 newest (trainer.keep_last); eval/loss 0.3, the best "
                "(trainer.keep_best=2)",
                2: "eval/loss 0.5, 2nd best (trainer.keep_best=2)",
            },
        ),
        (  # equal scores: the earlier is kept
            {2: ["best"], 4: ["best"]},
            {2: 0.5, 4: 0.5},
            LOSS,
            None,
            1,
            {2: "eval/loss 0.5, the best (trainer.keep_best=1)"},
        ),
        (  # max; an evaluation without a step_N/ ranks nothing
            {2: ["best"], 4: ["best"], 6: ["best"], 8: ["best"]},
            {2: 0.1, 4: 0.9, 6: 0.5, 8: 0.7, 10: 0.99},
            Monitor("eval/accuracy", "max"),
            None,
            4,
            {
                4: "eval/accuracy 0.9, the best (trainer.keep_best=4)",
                8: "eval/accuracy 0.7, 2nd best (trainer.keep_best=4)",
                6: "eval/accuracy 0.5, 3rd best (trainer.keep_best=4)",
                2: "eval/accuracy 0.1, 4th best (trainer.keep_best=4)",
            },
        ),
    ],
)
def test_kept_is_the_newest_and_the_best_with_why(
    written, scores, monitor, keep_last, keep_best, expected
):
    result = kept(written, scores, monitor, keep_last, keep_best)
    assert result == expected
    assert list(result) == list(expected)  # newest first, then best first


def ledger_of(tmp_path: Path, scores: dict[int, float], written: list[int]) -> Ledger:
    ledger = Ledger(tmp_path, {s: {"eval/loss": v} for s, v in scores.items()})
    ledger.written = {s: ["best"] for s in written}
    return ledger


@pytest.mark.parametrize(
    ("scores", "written", "step", "wanted"),
    [
        ({2: 0.5}, [], 2, True),  # the first evaluation
        ({2: 0.5, 4: 0.6}, [2], 4, True),  # fewer than keep_best=2 kept
        ({2: 0.5, 4: 0.6, 6: 0.55}, [2, 4], 6, True),  # better than the worst kept
        ({2: 0.5, 4: 0.6, 6: 0.6}, [2, 4], 6, False),  # a tie does not displace it
        ({2: 0.5, 4: 0.6, 6: 0.7}, [2, 4], 6, False),
        ({2: 0.5, 4: 0.6}, [2, 4], 6, False),  # no figure at step 6
        ({2: 0.5, 4: 0.6, 6: 0.1}, [2], 6, True),  # an evaluation not kept does not count
    ],
)
def test_an_evaluation_is_saved_if_it_ranks_among_the_best_kept(
    tmp_path: Path, scores, written, step, wanted
):
    retention = Retention(ledger_of(tmp_path, scores, written), LOSS, None, keep_best=2)
    assert retention.wants_best(step) is wanted


def test_without_keep_best_no_evaluation_is_saved(tmp_path: Path):
    retention = Retention(ledger_of(tmp_path, {2: 0.1}, []), LOSS, keep_last=2, keep_best=0)
    assert retention.wants_best(2) is False
