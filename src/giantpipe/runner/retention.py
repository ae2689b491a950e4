"""Which ``step_N/`` a run keeps: the ``trainer.keep_last`` newest that
``trainer.checkpoint_every`` wrote, and the ``trainer.keep_best`` best by the monitored figure.

Every other ``step_N/`` the run wrote goes (``last/`` is never touched), through the ledger's
crash-safe removal (:mod:`giantpipe.runner.ledger`). An evaluation that ranks among the best
kept so far is saved as ``step_N/`` (a tie does not displace the earlier one).

>>> kept({2: ["every"], 4: ["every"], 6: ["every", "best"]}, {2: 0.3, 6: 0.5},
...      Monitor("eval/loss", "min"), keep_last=1, keep_best=1)
{6: 'among the 1 newest (trainer.keep_last)', 2: 'eval/loss 0.3, the best (trainer.keep_best=1)'}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from giantpipe.runner.ledger import Ledger, folder_name
from giantpipe.runner.monitor import Monitor

EVERY, BEST = "every", "best"
"""Why a ``step_N/`` was written: trainer.checkpoint_every's cadence, trainer.keep_best."""
ORDINALS = ("the best", "2nd best", "3rd best")


def best(scores: Mapping[int, float], monitor: Monitor | None, count: int) -> list[int]:
    """The ``count`` best steps of ``scores`` by ``monitor``, best first."""
    return monitor.ranked(scores)[:count] if monitor is not None and count else []


def kept(
    written: Mapping[int, Sequence[str]],
    scores: Mapping[int, float],
    monitor: Monitor | None,
    keep_last: int | None,
    keep_best: int,
) -> dict[int, str]:
    """Of the ``step_N/`` ``written`` (step -> why it was written), those kept and why: the
    ``keep_last`` newest of trainer.checkpoint_every's (every one when None), and the
    ``keep_best`` best of those with a score; the others go."""
    reasons: dict[int, str] = {}
    cadence = sorted((s for s, why in written.items() if EVERY in why), reverse=True)
    for step in cadence if keep_last is None else cadence[:keep_last]:
        reasons[step] = (
            "written by trainer.checkpoint_every (trainer.keep_last=null keeps all)"
            if keep_last is None
            else f"among the {keep_last} newest (trainer.keep_last)"
        )
    scored = {s: v for s, v in scores.items() if s in written}
    for rank, step in enumerate(best(scored, monitor, keep_best)):
        assert monitor is not None  # best() ranks nothing without one
        place = ORDINALS[rank] if rank < len(ORDINALS) else f"{rank + 1}th best"
        reason = f"{monitor.key} {scored[step]:.6g}, {place} (trainer.keep_best={keep_best})"
        reasons[step] = f"{reasons[step]}; {reason}" if step in reasons else reason
    return reasons


class Retention:
    """Rank 0's keeper of the run's ``step_N/``: says whether an evaluation is saved as one of
    the best, records each save before it is written, and prunes once it is committed.

    Example::

        retention = Retention(ledger, Monitor("eval/loss", "min"), keep_last=2, keep_best=1)
        retention.wants_best(40)            # after the evaluation of step 40 is in the ledger
        retention.planned(40, [BEST])       # before the save
        retention.committed(40)             # after it: the others are pruned
    """

    def __init__(
        self, ledger: Ledger, monitor: Monitor | None, keep_last: int | None, keep_best: int
    ) -> None:
        self.ledger, self.monitor = ledger, monitor
        self.keep_last, self.keep_best = keep_last, keep_best
        self.pending: set[int] = set()
        """Steps planned whose save is not committed yet (trainer.async_save): never pruned."""
        self.removed: list[int] = []
        """The steps this process removed."""

    def scores(self) -> dict[int, float]:
        """The monitored figure of each evaluation that has one."""
        if self.monitor is None:
            return {}
        values = {s: self.monitor.value(f) for s, f in self.ledger.evaluations.items()}
        return {s: v for s, v in values.items() if v is not None}

    def wants_best(self, step: int) -> bool:
        """Whether the evaluation of ``step`` ranks among the ``keep_best`` best checkpoints
        kept so far (strictly better than the worst of them, when they are as many)."""
        if not self.keep_best or self.monitor is None:
            return False
        scores = self.scores()
        if step not in scores:
            return False
        held = {s: v for s, v in scores.items() if s in self.ledger.written and s != step}
        top = best(held, self.monitor, self.keep_best)
        return len(top) < self.keep_best or self.monitor.better(scores[step], held[top[-1]])

    def planned(self, step: int, why: list[str]) -> None:
        """Before ``step_N/`` is written: recorded, so that a kill cannot orphan it."""
        self.pending.add(step)
        self.ledger.planned(step, why)

    def committed(self, step: int) -> None:
        """``step_N/`` is committed: the ``step_N/`` no longer kept go."""
        self.pending.discard(step)
        self.prune()

    def decided(self) -> dict[int, str]:
        """The committed ``step_N/`` kept, and why."""
        written = {s: w for s, w in self.ledger.written.items() if s not in self.pending}
        return kept(written, self.scores(), self.monitor, self.keep_last, self.keep_best)

    def prune(self) -> None:
        """Removes every committed ``step_N/`` of the run that is not kept."""
        keep = self.decided()
        for step in sorted(self.ledger.written):
            if step in keep or step in self.pending:
                continue
            if self.ledger.remove(step, self._why_not()):
                self.removed.append(step)

    def _why_not(self) -> str:
        newest = "" if self.keep_last is None else f"among the {self.keep_last} newest"
        ranked = f"the {self.keep_best} best by {self.monitor.key}" if self.monitor else ""
        ranked = ranked if self.keep_best else ""
        return "not " + " nor ".join(part for part in (newest, ranked) if part)

    def summary(self) -> dict[str, str]:
        """``step_N`` -> why it is kept, for summary.json."""
        keep = self.decided()
        return {folder_name(step): keep[step] for step in sorted(keep)}
