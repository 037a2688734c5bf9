"""The shadow scorer (`sao shadow`): scores the policy versions the trainer asks for, in the background.

It loads the policy once and scores each requested version greedily (first try only where the env's
first turn decides success; whole episodes elsewhere, e.g. recall) on the validation slice
(`validation_tasks`: held-out tasks disjoint from those the run's final comparison uses), writing
RUN_DIR/shadow/vNNNNNN.json. The trainer asks for one version at a time through
RUN_DIR/shadow/request.json and decides what the scores mean (sao/trainer/shadow.py).
The base model (v0) is scored first: the scorer loads later versions over it in place.
It exits when its parent (the trainer) is gone or on SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from sao.config import SaoConfig
from sao.envs.registry import scores_first_turn_only
from sao.run_dir import RunDir
from sao.sampler.evaluation import Scorer, base_model_scores, validation_tasks
from sao.status import process_usage, write_status

log = logging.getLogger(__name__)


def serve(config: SaoConfig, run_dir: Path, poll_s: float = 0.2) -> None:
    run_dir = RunDir(run_dir)
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _exit_now)
    tasks = validation_tasks(config)
    # Where the first turn decides success (retry envs): that turn only, at half the cost of an episode with a retry.
    if scores_first_turn_only(config.env.name):
        config = config.model_copy(update={"env": config.env.model_copy(update={"max_turns": 1})})
    scorer = Scorer(config, run_dir.root, threads=1, slots=len(tasks))
    log.info("shadow scorer ready: %d validation tasks", len(tasks))
    done: set[int] = set()
    while os.getppid() == parent:
        version = _requested(run_dir)
        if version is None or version in done:
            time.sleep(poll_s)
            continue
        # Written whole (write_status): the trainer never reads half a result.
        write_status(run_dir.shadow_result(version), _score(scorer, version, tasks))
        done.add(version)


def _exit_now(*_: object) -> None:
    """SIGTERM ends the scorer at once, mid-score too: its score files are written whole or not at all."""
    raise SystemExit(0)


def _requested(run_dir: RunDir) -> int | None:
    try:
        return int(json.loads(run_dir.shadow_request.read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _score(scorer: Scorer, version: int, tasks) -> dict:
    started = time.perf_counter()
    try:
        # The base model's scores come from the held-out cache after the first run (its key holds the tasks).
        scores, failures = (base_model_scores(scorer, tasks)[0], {}) if version == 0 else scorer.score(version, tasks)
    except (OSError, ValueError, RuntimeError) as err:  # e.g. its file pruned, or a hash that does not match
        log.warning("v%d could not be scored: %s", version, err)
        return {"version": version, "error": str(err)}
    seconds = time.perf_counter() - started
    log.info("v%d: first-try success %.3f on %d validation tasks in %.1f s", version,
             sum(s["first_try"] for s in scores.values()) / max(len(scores), 1), len(scores), seconds)
    # The scorer's CPU seconds so far (model load included): what shadow validation has cost the run.
    return {"version": version, "successes": {t: s["first_try"] for t, s in scores.items()},
            "env_failures": len(failures), "seconds": seconds, "cpu_s": time.process_time(),
            "peak_rss_mb": process_usage()["peak_rss_mb"]}
