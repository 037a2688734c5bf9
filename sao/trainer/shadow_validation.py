"""Shadow validation in the training loop: hand versions to the scorer, follow its verdicts, roll back.

Rank 0 owns the scorer process and the board (sao/trainer/shadow.py); every rank keeps its own
optimizer snapshots (sao/trainer/snapshots.py) and does what rank 0 decides, agreed through a
broadcast, so the ZeRO-3 partitions of every rank move together. A new best version's whole file
(RUN_DIR/policy/best) is written by a background thread, like the snapshots: rebuilding it from its
delta chain takes seconds, which the step that reads the score does not wait for.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from sao import metrics
from sao.config import SaoConfig, TrainerConfig, to_toml
from sao.policy.weights import WeightsMismatch
from sao.run_dir import RunDir
from sao.status import write_status
from sao.trainer.distributed import from_leader
from sao.trainer.shadow import (
    Drop,
    ShadowBoard,
    ShadowScore,
    ShadowScorerProcess,
    earlier_board,
    link_best,
    run_in_background,
)
from sao.trainer.snapshots import OptimizerSnapshots

log = logging.getLogger(__name__)

FINAL_SCORE_WAIT_S = 600.0  # after the last step nothing else runs: the scorer has the machine


class ShadowValidation:
    """Every rank builds one; only rank 0's has a scorer (`scorer` None elsewhere)."""

    def __init__(self, config: TrainerConfig, run_dir: RunDir, scorer: ShadowScorerProcess | None,
                 board: ShadowBoard | None = None, cpus: set[int] | None = None):
        self.config, self.run_dir, self.scorer = config, run_dir, scorer
        self.board = board or ShadowBoard(config.shadow_margin)
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        self.snapshots = OptimizerSnapshots(run_dir.shadow_snapshots / f"rank{rank}", cpus)
        self.offered: int | None = None  # the last version handed to the scorer
        # Moves RUN_DIR/policy/best to the board's best (rank 0); niced, on the background CPUs.
        self._linker = ThreadPoolExecutor(1, "sao-best-link", initializer=run_in_background, initargs=(cpus,)) \
            if scorer is not None else None

    @classmethod
    def start(cls, config: SaoConfig, run_dir: RunDir, resume: bool = False,
              cpus: set[int] | None = None) -> ShadowValidation:
        """Rank 0 writes the trainer's config for the scorer and starts it now, so it loads its model while the
        trainer builds its engine (RANK: torch.distributed is not up yet). A resumed trainer goes on with the
        earlier lives' scores (their versions have no snapshot: no rollback to them)."""
        if os.environ.get("RANK", "0") != "0":
            return cls(config.trainer, run_dir, None, cpus=cpus)
        run_dir.root.mkdir(parents=True, exist_ok=True)
        run_dir.trainer_config.write_text(to_toml(config))
        board = earlier_board(run_dir, config.trainer.shadow_margin) if resume else None
        return cls(config.trainer, run_dir, ShadowScorerProcess(run_dir, run_dir.trainer_config, cpus), board, cpus)

    def pinned(self) -> set[int]:
        """Versions whose files must outlive trainer.keep_versions: the best one and the one being scored."""
        if self.scorer is None:
            return set()
        return {v for v in (self.board.best, self.scorer.pending) if v}

    def offer(self, engine, version: int) -> None:
        """Hand `version` to the scorer if it is idle and shadow_every versions have passed since the last one;
        then snapshot the optimizer at it, so a rollback can return here."""
        due = self.offered is None or version - self.offered >= self.config.shadow_every
        [offer] = from_leader([int(self.scorer is not None and due and self.scorer.idle)], engine.device)
        if not offer:
            return
        started = time.perf_counter()
        self.snapshots.take(engine, version)
        self.board.snapshot_s += time.perf_counter() - started
        self.offered = version
        if self.scorer is not None:
            self.scorer.request(version)

    def verdict(self, engine) -> int | None:
        """Read a new score; the version to roll back to (agreed by every rank) after a drop, else None."""
        back_to, best, pending = -1, -1, -1
        if self.scorer is not None:
            score = self.scorer.poll()
            if score is not None:
                drop = self._add(score)
                if drop is not None:
                    back_to = self._alert(drop)
                self.write()
            best = -1 if self.board.best is None else self.board.best
            pending = -1 if self.scorer.pending is None else self.scorer.pending
        back_to, best, pending = from_leader([back_to, best, pending], engine.device)
        self.snapshots.keep_only({best, pending} - {-1})
        return back_to if back_to >= 0 else None

    def roll_back(self, engine, version: int, publish: Callable[[], int], step: int, dropped_at: int) -> dict:
        """Every rank: restore `version` and publish its weights again (`publish` returns the new version);
        `dropped_at` is the version training had reached."""
        self.snapshots.restore(engine, version)
        published_as = publish()
        self.snapshots.relabel(version, published_as)
        event = {"step": step, "from_version": dropped_at, "to_version": version, "published_as": published_as}
        if self.scorer is not None:
            self.board.alias(published_as, version)
            self.board.rollbacks.append(event)
            metrics.TRAINER_ROLLBACKS.inc()
            self.write()
            log.warning("rolled back from v%d to v%d's weights and optimizer state, published as v%d", dropped_at,
                        version, published_as)
        return event

    def finish(self, final_version: int) -> None:
        """Rank 0, after the last step: score the final version too, so the kept best is chosen among all."""
        if self.scorer is None:
            return
        if self.scorer.pending is not None:  # asked for before the last step
            self._add_late(self.scorer.wait(FINAL_SCORE_WAIT_S), final=False)
        if final_version not in self.board.scores and self.scorer.idle:
            self.scorer.request(final_version)
            self._add_late(self.scorer.wait(FINAL_SCORE_WAIT_S), final=True)
        self.write()
        self.scorer.stop()
        self._linker.shutdown(wait=True)  # the run ends with the link on the best it kept

    def stop(self) -> None:
        """At the trainer's exit: the snapshots die with its process (a resume cannot use them), so do their files."""
        self.snapshots.keep_only(set())
        self.snapshots.close()
        if self.scorer is not None:
            self.scorer.stop()
            self._linker.shutdown(wait=True)

    def status(self) -> dict | None:
        if self.scorer is None:
            return None
        return {**self.board.to_json(), "scorer_failed": self.scorer.failed}

    def write(self) -> None:
        """board.json (written whole, then renamed) now; the RUN_DIR/policy/best link in the background."""
        write_status(self.run_dir.shadow_board, self.status())
        self._linker.submit(self._link_best)

    def _link_best(self) -> None:
        """Link the board's best as it is when this runs (a request overtaken by a newer best costs nothing). The best
        version's files are pinned (`pinned`) while it is best. A failure costs the link, never the training."""
        best = self.board.best
        try:
            link_best(self.run_dir, best)
        except (OSError, ValueError, WeightsMismatch) as err:
            log.error("RUN_DIR/policy/best could not be moved to v%s (%s); board.json names the best", best, err)

    def _add(self, score: ShadowScore) -> Drop | None:
        self.board.scorer_cpu_s = self.scorer.cpu_s
        self.board.scorer_peak_rss_mb = self.scorer.peak_rss_mb
        drop = self.board.add(score)
        metrics.record_shadow_score(score.version, score.mean, self.board.best)
        log.info("shadow: v%d first-try success %.3f ± %.3f (n %d); best v%d", score.version, score.mean,
                 score.stderr or 0.0, score.n, self.board.best)
        return drop

    def _alert(self, drop: Drop) -> int:
        """Log and count a drop; the version to roll back to, or -1."""
        restorable = drop.best in self.snapshots
        rolls_back = self.config.rollback and restorable
        log.warning("ALERT shadow validation: v%d scored %.3f below the top, v%d (%.1f standard errors of the paired "
                    "difference; margin %.1f); the best is v%d: %s", drop.version, -drop.gap, drop.top,
                    -drop.gap / drop.stderr if drop.stderr else float("inf"), self.config.shadow_margin, drop.best,
                    "rolling back to it" if rolls_back else
                    "trainer.rollback is off" if not self.config.rollback else
                    "not restorable in this life (no snapshot): training goes on")
        metrics.SHADOW_DROPS.inc()
        return drop.best if rolls_back else -1

    def _add_late(self, score: ShadowScore | None, final: bool) -> None:
        """A score read after the last step: a drop can no longer be rolled back, only not kept."""
        if score is None:
            return
        drop = self._add(score)
        if drop is not None:
            log.warning("ALERT shadow validation: %s v%d scored %.3f below the top, v%d; the run keeps v%d "
                        "(RUN_DIR/policy/best)", "the final version" if final else "version", drop.version,
                        -drop.gap, drop.top, drop.best)
            metrics.SHADOW_DROPS.inc()


class NoShadow:
    """trainer.shadow_every = 0: no version is scored, so none is rolled back or pinned."""

    def pinned(self) -> set[int]:
        return set()

    def offer(self, engine, version: int) -> None:
        pass

    def verdict(self, engine) -> int | None:
        return None

    def finish(self, final_version: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def status(self) -> dict | None:
        return None
