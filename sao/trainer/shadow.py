"""Shadow validation, the trainer's side: which published version is best, and whether the newest fell.

A background process (`sao shadow`, sao/sampler/shadow.py) scores the versions the trainer asks
for, one at a time, on a fixed validation slice of held-out tasks; training never waits for it.
The trainer asks whenever the scorer is idle and `trainer.shadow_every` versions have passed,
snapshotting the optimizer at that version first (sao/trainer/snapshots.py), so any scored version
can be returned to exactly. `ShadowBoard` keeps the scores: the top version (the highest score,
ties to the later one); a *drop* when a newer version is below the top by more than `shadow_margin`
standard errors of their paired difference on the same tasks; and the best version, the one the run
keeps: the newest that is no drop. On a small slice the highest score is partly luck, so a later
version the slice cannot tell from it, trained on more, is the better one to keep.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sao.config import SaoConfig
from sao.policy.chain import read_version_state
from sao.policy.weights import write_weights
from sao.processes import die_with_parent
from sao.run_dir import RunDir
from sao.stats import paired_gain, stderr
from sao.status import write_status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShadowScore:
    """First-try success per validation task (1.0 or 0.0) of one version."""

    version: int
    successes: dict[str, float]
    seconds: float = 0.0
    same_as: int | None = None  # a version published with another's weights (a rollback): not scored again

    @property
    def n(self) -> int:
        return len(self.successes)

    @property
    def mean(self) -> float:
        return sum(self.successes.values()) / self.n if self.n else float("nan")

    @property
    def stderr(self) -> float | None:
        return stderr(list(self.successes.values()))


@dataclass(frozen=True)
class Drop:
    """`version` scored below the top version by `gap` (negative) with `stderr` the paired standard error;
    `best` is the version the run keeps instead, the one a rollback returns to."""

    version: int
    top: int
    best: int
    gap: float
    stderr: float


@dataclass
class ShadowBoard:
    margin: float
    scores: dict[int, ShadowScore] = field(default_factory=dict)
    best: int | None = None  # the version the run keeps: the newest that is no drop
    top: int | None = None  # the highest score (ties to the later version), which drops are measured from
    scorer_cpu_s: float = 0.0  # the scorer process's CPU seconds, as of its latest score
    scorer_peak_rss_mb: float | None = None  # the scorer process's resident memory at its highest, likewise
    snapshot_s: float = 0.0  # the trainer's seconds spent snapshotting the optimizer for it
    drops: list[Drop] = field(default_factory=list)
    rollbacks: list[dict] = field(default_factory=list)

    def add(self, score: ShadowScore) -> Drop | None:
        """Record a version's score; the Drop if it fell below the top by more than the margin."""
        self.scores[score.version] = score
        if self.top is None or score.mean >= self.scores[self.top].mean:
            self.top = self.best = score.version
            return None
        top = self.scores[self.top]
        shared = sorted(set(top.successes) & set(score.successes))
        gap, error = paired_gain([top.successes[t] for t in shared], [score.successes[t] for t in shared])
        # All tasks moving the same way leaves no spread: a certain drop, not an unmeasurable one.
        if gap is not None and error is not None and gap < 0 and (error == 0 or gap < -self.margin * error):
            drop = Drop(score.version, self.top, self.best, gap, error)
            self.drops.append(drop)
            return drop
        self.best = score.version
        return None

    def alias(self, version: int, same_as: int) -> None:
        """`version` carries `same_as`'s weights (a rollback published them again): it takes its score."""
        original = self.scores[same_as]
        self.scores[version] = ShadowScore(version, original.successes, 0.0, same_as)
        if self.best == same_as:
            self.best = version
        if self.top == same_as:
            self.top = version

    def to_json(self) -> dict:
        def figures(score: ShadowScore) -> dict:
            return {"success": score.mean, "stderr": score.stderr, "n": score.n, "seconds": score.seconds,
                    "same_as": score.same_as}

        best = self.scores[self.best] if self.best is not None else None
        return {"margin": self.margin, "scores": {str(v): figures(s) for v, s in sorted(self.scores.items())},
                "best": {"version": best.version, **figures(best)} if best else None, "top": self.top,
                "scorer_cpu_s": self.scorer_cpu_s, "scorer_peak_rss_mb": self.scorer_peak_rss_mb,
                "snapshot_s": self.snapshot_s,
                "drops": [asdict(drop) for drop in self.drops], "rollbacks": self.rollbacks}


def earlier_board(run_dir: RunDir, margin: float) -> ShadowBoard:
    """The board of the run's earlier lives, rebuilt from the scores they left (for a resumed trainer).

    Each score file holds its per-task successes, so later versions are compared with the earlier
    best exactly as within one life; versions a rollback republished keep their `same_as`.
    """
    board = ShadowBoard(margin)
    for path in sorted(run_dir.shadow_dir.glob("v*.json")):
        try:
            result = json.loads(path.read_text())
            board.add(ShadowScore(int(result["version"]), {t: float(v) for t, v in result["successes"].items()},
                                  float(result.get("seconds", 0.0))))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a version that could not be scored (its result names the error) or a foreign file
    try:
        earlier = json.loads(run_dir.shadow_board.read_text())
    except (OSError, ValueError):
        return board
    aliases = {int(v): figures["same_as"] for v, figures in (earlier.get("scores") or {}).items()
               if isinstance(figures, dict) and figures.get("same_as") is not None}
    for version, same_as in sorted(aliases.items()):
        if same_as in board.scores:
            board.alias(version, same_as)
    board.rollbacks = list(earlier.get("rollbacks") or [])
    return board


def background_cpus(config: SaoConfig) -> set[int]:
    """The CPUs for the run's background work (shadow scorer, snapshot writes): those the run's processes may
    use (`SaoConfig.run_cpus`, with the trainer's parent as the launcher), less a pinned trainer's
    (`trainer.cpu_affinity`) when others are left: there it would lengthen a step, while the samplers' CPUs
    have the slack of a run that waits on its trainer."""
    try:
        started_by = set(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone: this process's own CPUs are what is known
        started_by = set(os.sched_getaffinity(0))
    run = config.run_cpus(started_by)
    return (run - set(config.trainer.cpu_affinity or ())) or run


def run_in_background(cpus: set[int] | None) -> None:
    """Make the calling thread background work: niced (10), and allowed on `cpus` (`background_cpus`), not
    a pinned trainer's alone. Linux applies both to the calling thread alone: a forked child's only thread, or
    a worker thread of the trainer."""
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    if cpus:
        os.sched_setaffinity(0, cpus)


def _scorer_child(cpus: set[int] | None, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    run_in_background(cpus)


class ShadowScorerProcess:
    """Rank 0: starts `sao shadow`, hands it one version at a time, and reads back its scores.

    The scorer never outlives the trainer: it is stopped at the trainer's exit (atexit) whatever path it
    takes, and the kernel sends it SIGTERM if the trainer dies without one (a signal, SIGKILL)."""

    def __init__(self, run_dir: RunDir, config_path: Path, cpus: set[int] | None = None):
        self.run_dir = run_dir
        run_dir.shadow_dir.mkdir(parents=True, exist_ok=True)
        run_dir.shadow_request.unlink(missing_ok=True)
        self.pending: int | None = None  # the version asked for and not yet scored
        self.cpu_s = 0.0  # the scorer's CPU seconds, as of its latest result
        self.peak_rss_mb: float | None = None  # its resident memory at its highest, likewise
        self.failed: str | None = None  # why the scorer is gone: nothing more is asked of it, training goes on
        log_path = run_dir.log("shadow")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Niced (10): it runs mostly on the CPU the samplers and the trainer leave, but a busy process on the
        # same CPU still cedes it a small share (nice 10 weighs about a tenth of nice 0). On `cpus`
        # (`background_cpus`): off a pinned trainer's, so it takes the samplers' idle time, not a step's.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sao.cli", "shadow", "--config", str(config_path), "--run-dir", str(run_dir.root)],
            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(_scorer_child, cpus, os.getpid()))
        atexit.register(self.stop)  # an exception or exit anywhere in the trainer, its start-up included

    @property
    def idle(self) -> bool:
        return self.pending is None and self.failed is None

    def request(self, version: int) -> None:
        write_status(self.run_dir.shadow_request, {"version": version})  # written whole: never half a request
        self.pending = version

    def poll(self) -> ShadowScore | None:
        """The pending version's score once written (a version the scorer could not load scores as nothing)."""
        if self.pending is None or self.failed is not None:
            return None
        path = self.run_dir.shadow_result(self.pending)
        if not path.is_file():
            if self.process.poll() is not None:
                self.failed = (f"the shadow scorer exited with code {self.process.returncode} (see "
                               f"{self.run_dir.log('shadow')}); no more versions are scored")
                log.error("%s", self.failed)
            return None
        result = json.loads(path.read_text())
        self.pending = None
        self.cpu_s = result.get("cpu_s", self.cpu_s)
        self.peak_rss_mb = result.get("peak_rss_mb", self.peak_rss_mb)
        if result.get("error"):
            log.warning("shadow scorer could not score v%d: %s", result["version"], result["error"])
            return None
        return ShadowScore(result["version"], {t: float(s) for t, s in result["successes"].items()}, result["seconds"])

    def wait(self, timeout_s: float) -> ShadowScore | None:
        """Block until the pending version is scored (at the end of training, when nothing else runs).

        None when it could not be: the scorer failed or exited, or `timeout_s` passed. The run then
        ends without that score, which the board shows; training's outcome is not at stake.
        """
        deadline = time.monotonic() + timeout_s
        while self.pending is not None and self.failed is None and time.monotonic() < deadline:
            score = self.poll()
            if score is not None or self.pending is None:
                return score
            time.sleep(0.2)
        if self.pending is not None and self.failed is None:
            log.warning("the shadow scorer did not score v%d within %.0f s: the last score is missing", self.pending,
                        timeout_s)
        return None

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def link_best(run_dir: RunDir, version: int | None) -> None:
    """RUN_DIR/policy/best -> the best version's whole weights file; no link while the base model (v0) is best.

    A version published as a delta is written whole once (best-vN), so the link always names a file
    that loads alone; the export of a version no longer best goes once the link has moved. The link is
    replaced in one rename: a reader finds the old best or the new one, never no link mid-write.
    """
    link = run_dir.best_weights
    target = run_dir.weights(version) if version else None
    if version and not target.is_file() and run_dir.weights_delta(version).is_file():
        target = run_dir.best_export(version)
        if not target.is_file():
            write_weights(read_version_state(run_dir, version), target)  # atomic: never half a file
    if target is None:
        link.unlink(missing_ok=True)
    else:
        fresh = link.with_name(link.name + ".new")
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(target.name)
        fresh.replace(link)
    for export in run_dir.best_exports():
        if export != target:
            export.unlink(missing_ok=True)
