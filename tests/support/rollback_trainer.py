"""`sao trainer` whose shadow validation rolls back once, before step ROLLBACK_BEFORE_STEP, to v1, with no scorer.

A tiny random policy solves nothing, so no real score ever drops; this stands in for the scorer and
its verdict so that a tiny run takes the rollback path itself: snapshots of the offered versions,
restore, republish, the ledger and the trajectory log. Usage: like `python -m sao.cli`.
"""

from sao.cli import app
from sao.trainer import shadow_validation
from sao.trainer.shadow import ShadowScore

ROLLBACK_BEFORE_STEP = 4
ROLLBACK_TO = 1


class IdleScorer:
    """Takes every request and never answers."""

    pending = None
    failed = None
    cpu_s = 0.0
    peak_rss_mb = None
    idle = True

    def __init__(self, *args, **kwargs):
        pass

    def request(self, version: int) -> None:
        pass

    def poll(self):
        return None

    def wait(self, timeout: float):
        return None

    def stop(self) -> None:
        pass


verdicts = iter(range(1, 1 << 30))  # how many steps have asked for a verdict so far, the current one included


def verdict(self, engine) -> int | None:
    if next(verdicts) != ROLLBACK_BEFORE_STEP:
        return None
    self.board.scores[ROLLBACK_TO] = ShadowScore(ROLLBACK_TO, {"task": 1.0})
    self.board.best = ROLLBACK_TO
    return ROLLBACK_TO


shadow_validation.ShadowScorerProcess = IdleScorer
shadow_validation.ShadowValidation.verdict = verdict

if __name__ == "__main__":
    app()
