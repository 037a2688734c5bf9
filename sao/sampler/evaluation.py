"""Held-out evaluation: greedy, batched scores of policy versions on the env's eval split.

`sao eval` scores one version (optionally against a baseline); `sao run` ends by comparing the
base model (version 0) with its final version on the same tasks. The trainer keeps the last
`trainer.keep_versions` versions on disk with a JSON sidecar holding their sha256; any of them,
or version 0, can be scored. Actions are greedy by default, so two versions differ only by their
weights; each distinct held-out task is scored once (up to a cap), and the comparison is paired:
per task, first-try success of the final version minus that of the base. Second-try success
(right at the second attempt, among the tasks whose first attempt failed) is reported per
version with its own n: the tasks a version gets wrong first differ between versions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sao.config import SaoConfig
from sao.envs.guard import EnvFailure
from sao.envs.registry import episode_success, make_tasks, turns_are_attempts
from sao.metrics import record_heldout_skills
from sao.policy.chain import ChainReader
from sao.run_dir import RunDir
from sao.sampler.rollout import Roller
from sao.sampler.skills import skill_figures, tag_tasks
from sao.schema import Task
from sao.stats import mean, paired_gain, stderr
from sao.status import attempt_success, write_atomically

log = logging.getLogger(__name__)

# task id -> {"first_try": 0 or 1 (an env that defines `success`, e.g. recall: that, in [0, 1]), "second_try": 0 or 1
# or None (no second attempt), "second_penalised": 0 or 1 or
# None (the env scored the second attempt below 0: arithmetic's repeat_penalty), "reward": total reward}
TaskScores = dict[str, dict[str, float | None]]


def weights_of(run_dir: Path, version: int) -> tuple[Path, str]:
    """Weights file and sha256 of a published version, from its sidecar."""
    run_dir = RunDir(run_dir)
    sidecar = run_dir.weights_sidecar(version)
    if not sidecar.is_file():
        raise FileNotFoundError(f"policy v{version} is not in {run_dir.policy_dir} (kept: "
                                f"{run_dir.kept_versions() or 'none'}; raise trainer.keep_versions to keep more)")
    return run_dir.weights(version), json.loads(sidecar.read_text())["sha256"]


def _distinct_eval_tasks(config: SaoConfig, count: int) -> list[Task]:
    """The first distinct tasks among the eval split's first `count`, in split order.

    A small split repeats itself (arithmetic's default domain after 129 tasks, humaneval's after
    33); a task is what its spec asks, whatever its id.
    """
    distinct: dict[str, Task] = {}
    for task in make_tasks(config.env, count, split="eval"):
        distinct.setdefault(json.dumps(task.spec, sort_keys=True, default=str), task)
    return list(distinct.values())


def best_version(run_dir: Path) -> int:
    """The version shadow validation kept as best (RUN_DIR/shadow/board.json)."""
    board = RunDir(run_dir).shadow_board
    if not board.is_file():
        raise FileNotFoundError(f"{board} does not exist: the run had no shadow validation (trainer.shadow_every = 0)")
    best = json.loads(board.read_text()).get("best")
    if not best:
        raise ValueError(f"{board} names no best version: no version was scored")
    return int(best["version"])


def validation_tasks(config: SaoConfig) -> list[Task]:
    """Shadow validation's slice of the eval split: up to `trainer.shadow_tasks` distinct tasks after the
    first `run.heldout_cap`, so picking the best version never sees the tasks it is then judged on. A
    split too small for both (humaneval's) is shared: validation takes at most its last half.
    """
    cap, wanted = config.run.heldout_cap, config.trainer.shadow_tasks
    distinct = _distinct_eval_tasks(config, cap + wanted)
    reserved = min(wanted, max(len(distinct) - cap, len(distinct) // 2))
    return distinct[len(distinct) - reserved:]


def heldout_tasks(config: SaoConfig, cap: int) -> list[Task]:
    """Up to `cap` distinct eval tasks: what the final comparison scores. With shadow validation on,
    none of its slice; off, the comparison may use the whole split."""
    validation = {task.task_id for task in validation_tasks(config)} if config.trainer.shadow_every else set()
    return [task for task in _distinct_eval_tasks(config, cap + len(validation))
            if task.task_id not in validation][:cap]


class Scorer:
    """One policy, encoder and filter, loaded once; `score` runs a version on tasks in batches."""

    def __init__(self, config: SaoConfig, run_dir: Path, threads: int | None = None, slots: int | None = None):
        torch.set_num_threads(threads or config.sampler.threads(config.run.mode))
        self.config, self.run_dir = config, Path(run_dir)
        self.slots = slots or config.run.heldout_batch
        self.roller = Roller.from_config(config, sampler_id="eval", seed=0)
        self.policy = self.roller.policy
        self.loaded_version: int | None = 0  # the base model; None after a load that failed half-way
        self.reader = ChainReader(self.policy)  # holds the last version loaded: the next costs its own deltas

    @property
    def device(self) -> str:
        parameter = next(self.policy.parameters())
        engine = "vllm" if self.roller.engine is not None else "hf"  # greedy answers may differ between engines
        return f"{parameter.device.type}/{parameter.dtype}/{engine}"

    def load(self, version: int) -> None:
        if version == self.loaded_version:
            return
        if version == 0:
            raise ValueError("the base model (v0) must be scored before any other version is loaded")
        self.loaded_version = None
        self.reader.read(RunDir(self.run_dir), version)
        self.roller.weights_changed()
        self.loaded_version = version

    def score(self, version: int, tasks: list[Task], greedy: bool = True) -> tuple[TaskScores, dict[str, str]]:
        """Per task: first-try success (the first turn's reward >= 1; the env's own `success` where it defines one),
        second-try success (see `attempt_success`; None in an env whose turns are not attempts) and total reward;
        and the tasks whose env failed, with the failure."""
        self.load(version)
        success = episode_success(self.config.env.name)
        attempts = turns_are_attempts(self.config.env.name)  # else a second turn is no second try
        scores: TaskScores = {}
        failures: dict[str, str] = {}
        outcomes = self.roller.rollout_batch(tasks, version, greedy, slots=self.slots,
                                             on_done=_progress_log(f"v{version}", len(tasks), self.slots))
        for task, outcome in zip(tasks, outcomes):
            if isinstance(outcome, EnvFailure):
                failures[task.task_id] = str(outcome)
            else:
                rewards = [step.reward for step in outcome.steps]
                second_try = attempt_success(rewards)[1] if attempts else None
                penalised = None if second_try is None else float(outcome.steps[1].reward < 0)
                scores[task.task_id] = {"first_try": success(task.spec, rewards), "second_try": second_try,
                                        "second_penalised": penalised, "reward": outcome.total_reward}
        if failures:
            log.warning("v%d: the env failed on %d of %d held-out tasks (left out), e.g. %s", version, len(failures),
                        len(tasks), next(iter(failures.values())))
        return scores, failures


PROGRESS_EVERY_S = 15.0  # how often a scoring logs how far it got


def _progress_log(what: str, total: int, side_by_side: int = 1, every_s: float = PROGRESS_EVERY_S
                  ) -> Callable[[int], None]:
    """An `on_done` for rollout_batch that logs 'done of total' at most every `every_s` seconds, with the time left
    once `side_by_side` tasks are done: before that the tasks done are the batch's quickest, and a rate from them
    overstates the time left many times over."""
    started = reported = time.perf_counter()

    def on_done(done: int) -> None:
        nonlocal reported
        now = time.perf_counter()
        if now - reported >= every_s and done < total:
            reported = now
            left = f", about {(now - started) / done * (total - done):.0f} s left" if done >= side_by_side else ""
            log.info("%s: %d of %d tasks scored in %.0f s%s", what, done, total, now - started, left)

    return on_done


def second_tries(scores: TaskScores, task_ids: list[str], figure: str = "second_try") -> list[float]:
    """Second-try successes (or `second_penalised`) of the tasks that had a second attempt, in task order."""
    return [scores[t][figure] for t in task_ids if scores[t]["second_try"] is not None]


def _figures(scores: TaskScores) -> dict:
    first_try, second_try = [s["first_try"] for s in scores.values()], second_tries(scores, list(scores))
    return {"n": len(scores), "first_try_success": mean(first_try), "first_try_stderr": stderr(first_try),
            "second_try_success": mean(second_try), "second_try_stderr": stderr(second_try),
            "second_try_n": len(second_try),
            "second_try_penalised": mean(second_tries(scores, list(scores), "second_penalised")),
            "reward_mean": mean([s["reward"] for s in scores.values()])}


def evaluate(config: SaoConfig, run_dir: Path, version: int, num_tasks: int, greedy: bool = True) -> dict:
    """Score one version on up to `num_tasks` distinct held-out tasks; writes RUN_DIR/eval/vN.json."""
    started = time.perf_counter()
    tasks = heldout_tasks(config, num_tasks)
    scores, failures = Scorer(config, run_dir).score(version, tasks, greedy)
    result = {"version": version, "tasks": len(tasks), "greedy": greedy, "split": "eval", **_figures(scores),
              "env_failures": len(failures), "seconds": time.perf_counter() - started, "per_task": scores}
    out = RunDir(run_dir).eval_result(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


# --- the paired comparison -----------------------------------------------------------------------

def _cache_path(config: SaoConfig, tasks: list[Task], device: str) -> Path | None:
    """Where the base model's scores on these tasks under these settings are kept (None: no cache).

    The key holds everything a greedy episode of the base model depends on: model, generation and
    projector settings, compression, the env's settings and the tasks themselves (their specs name
    what was asked, so env.seed only counts where the eval split depends on it).
    """
    if not config.run.heldout_cache_dir:
        return None
    material = {"policy": config.policy.model_dump(exclude={"cache_dir"}), "compression": config.compression.model_dump(),
                "env": config.env.model_dump(exclude={"seed"}), "device": device,
                "tasks": [[task.task_id, task.spec] for task in tasks]}
    key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return Path(config.run.heldout_cache_dir).expanduser() / f"{key}.json"


_CACHED_FIELDS = {"first_try": (int, float), "second_try": (int, float, type(None)),
                  "second_penalised": (int, float, type(None)), "reward": (int, float)}


def _cached_base(path: Path | None, tasks: list[Task]) -> TaskScores | None:
    if path is None or not path.is_file():
        return None
    try:
        scores = json.loads(path.read_text())["scores"]
        # A cache written before second tries (or their penalties) were scored lacks them: scored again.
        if all(isinstance(scores[t.task_id].get(k, "missing"), types)
               for t in tasks for k, types in _CACHED_FIELDS.items()):
            return {t.task_id: scores[t.task_id] for t in tasks}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("held-out cache %s is unreadable (%s); scoring the base model again", path, err)
        return None
    log.warning("held-out cache %s lacks some tasks or figures; scoring the base model again", path)
    return None


def base_model_scores(scorer: Scorer, tasks: list[Task]) -> tuple[TaskScores, bool]:
    """The base model's (v0's) scores on `tasks`, from the cache when it holds them; and whether it did."""
    cache = _cache_path(scorer.config, tasks, scorer.device)
    cached = _cached_base(cache, tasks)
    if cached is not None:
        return cached, True
    scores, failures = scorer.score(0, tasks)
    if cache is not None and not failures:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache, json.dumps({"scores": scores}))
    return scores, False


def compare(config: SaoConfig, run_dir: Path, version: int, baseline: int = 0, cap: int | None = None,
            threads: int | None = None, kept: int | None = None) -> dict:
    """Score `baseline` and `version` greedily on the same held-out tasks; the paired first-try gain,
    and each version's second-try success (with its own n, among its own first-try failures).

    `kept`, the version shadow validation kept as best, is scored too when it is another one, and
    its paired gain over `baseline` reported beside the final version's (`heldout_kept_*`).
    Success is also broken down by the skills the env tags tasks with (`heldout_skill*`, with the
    format-only ceiling: sao/sampler/skills.py).
    The base model's scores (baseline 0) come from the cache when it holds them. Tasks on which
    the env failed in any version are left out of the pairing. Writes RUN_DIR/eval/heldout.json.
    """
    started = time.perf_counter()
    for needed in {baseline, version, kept or 0} - {0}:
        weights_of(run_dir, needed)  # a pruned version fails now, not after scoring the other one
    tasks = heldout_tasks(config, cap or config.run.heldout_cap)
    scorer = Scorer(config, run_dir, threads=threads)
    if baseline == 0:
        base, base_cached = base_model_scores(scorer, tasks)
    else:
        (base, _), base_cached = scorer.score(baseline, tasks), False
    base_s = time.perf_counter() - started
    # The kept version is scored before the final one only to load versions in the order they were made.
    kept_scores = None
    if kept is not None and kept not in (baseline, version):
        kept_scores = base if kept == 0 else scorer.score(kept, tasks)[0]
    final, _ = scorer.score(version, tasks)
    # The kept (best) version's scores: the final's or the base's when it is one of them (None: no kept version).
    kept_view = final if kept == version else base if kept == baseline else kept_scores
    paired = [task.task_id for task in tasks if task.task_id in base and task.task_id in final
              and (kept_scores is None or task.task_id in kept_scores)]
    gain, gain_stderr = paired_gain([base[t]["first_try"] for t in paired], [final[t]["first_try"] for t in paired])
    reward_gain, reward_stderr = paired_gain([base[t]["reward"] for t in paired], [final[t]["reward"] for t in paired])
    base_second, final_second = second_tries(base, paired), second_tries(final, paired)
    tags = tag_tasks(config.env.name, [task for task in tasks if task.task_id in set(paired)])
    by_version = {"base": base, "final": final, **({"kept": kept_view} if kept_view else {})}
    skills = skill_figures(tags, {name: {t: scores[t]["first_try"] for t in paired} for name, scores in by_version.items()})
    result = {
        "heldout_base": mean([base[t]["first_try"] for t in paired]),
        "heldout_final": mean([final[t]["first_try"] for t in paired]),
        "heldout_gain": gain, "heldout_gain_stderr": gain_stderr, "heldout_n": len(paired),
        "heldout_reward_base": mean([base[t]["reward"] for t in paired]),
        "heldout_reward_final": mean([final[t]["reward"] for t in paired]),
        "heldout_reward_gain": reward_gain, "heldout_reward_gain_stderr": reward_stderr,
        "heldout_second_try_base": mean(base_second), "heldout_second_try_base_stderr": stderr(base_second),
        "heldout_second_try_base_n": len(base_second),
        "heldout_second_try_final": mean(final_second), "heldout_second_try_final_stderr": stderr(final_second),
        "heldout_second_try_n": len(final_second),
        "heldout_second_try_penalised_base": mean(second_tries(base, paired, "second_penalised")),
        "heldout_second_try_penalised_final": mean(second_tries(final, paired, "second_penalised")),
        "base_version": baseline, "final_version": version, "tasks": len(tasks), "base_cached": base_cached,
        "base_seconds": base_s, "final_seconds": time.perf_counter() - started - base_s,
        **_kept_figures(kept, base, kept_view, paired),
        **skills,
        # Per task, so that runs on the same tasks can be compared paired by task.
        "per_task": {t: {"base": base[t], "final": final[t], **({"kept": kept_view[t]} if kept_view else {})}
                     for t in paired},
        "skills_by_task": tags,
    }
    record_heldout_skills(skills["heldout_skills"], skills["heldout_format_ceiling"], skills["heldout_skill"])
    out = RunDir(run_dir).heldout
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def _kept_figures(kept: int | None, base: TaskScores, scores: TaskScores | None, paired: list[str]) -> dict:
    """The kept version's first-try success and paired gain over the base, on the same tasks."""
    if kept is None or scores is None:
        return {}
    gain, gain_stderr = paired_gain([base[t]["first_try"] for t in paired], [scores[t]["first_try"] for t in paired])
    return {"kept_version": kept, "heldout_kept": mean([scores[t]["first_try"] for t in paired]),
            "heldout_kept_gain": gain, "heldout_kept_gain_stderr": gain_stderr}
