"""Async vs sync: sao's asynchronous default against synchronous training, same env, model, tasks, seeds and compute.

    python benchmarks/async_vs_sync.py [--tasks 48] [--seeds 0 1 2] [--arms grpo sync async resampled]
        [--heldout-cap 128] [--group-size 8] [--pinned | --unpinned | --both] [--runs-dir runs/bench/async_vs_sync]
        [--repeats 1] [--merge RUNS_DIR ...] [--json PATH] [--keep-weights]
        [-- extra sao run args]

Four arms, each one `sao run` (its own run directory) on the same number of trajectories:
(a) synchronous GRPO, `--group-size` copies per task (tasks / group-size tasks); (b) synchronous
single-trajectory, `run.mode = "sync"`: one batch released, sampled with the newest version, trained
and published before the next; (c) sao's asynchronous default; (d) `resampled`: (b) again with
another `sampler.seed`, the same tasks with other tokens drawn: sync against itself. Each arm runs unpinned (the OS
places every process) and pinned (samplers on the first half of the CPUs, the trainer on the other
half: the CPU stand-in for separate sampler and trainer pools; the broker, launcher and feeder share
the samplers' half, and so does the final held-out evaluation).

Per arm, from summary.json: trajectories trained per second (over the training part, and in steady
state: from the first optimizer step to the last), trainer and sampler idle ratios, mean staleness,
sampling -> training delay p50/p95 in seconds and in trainer steps, the held-out gain with its
standard error, and wall seconds. From the sync arm (batches after the first, which waits for start-up):
S = mean seconds from a batch's release to its last trajectory, T = mean trainer step including the
publish, and the most overlap can give,
bound = (S + T) / max(S, T). Headline: async / sync steady-state rate, pinned, beside that bound.
After the first step the arms sample with different policies, so their batches hold different work (turns,
tokens); per seed, each run's own S (sampler busy seconds per batch) and T also give a work-matched bound and
each arm's efficiency: its ideal seconds per batch (S + T sync, max(S, T) async) over its steady ones.

Learning: one run of an arm moves its held-out gain by up to 0.5 between seeds, and by up to 0.5
between runs of the same seed too (the run's own randomness: which version samples which task, which
tokens are drawn), far more than the ± over questions of one run. "Async learns as much as sync" is
judged on the per-seed difference async - sync (each arm's mean over its runs of the seed), its mean
± the standard error across seeds; with one seed only the error over questions is left, and the
JSON says so (`difference_error`). Rates are averaged over runs the same way (the headline: mean
async rate / mean sync rate).

Per seed the verdict needs the run-to-run spread, which one run cannot show: `--repeats K` runs
every arm K times a seed (repeat r draws with `sampler.seed` 2r), and `--merge` pools the runs of
earlier invocations whose config matches. Each arm's run-to-run variance is pooled over seeds (the
deviations from each seed's own mean), and a seed's async - sync is called within 2 s.e. of
sqrt(var_async / n_async + var_sync / n_sync), or behind (`seed_learning`).

Per run pair, async - sync is also paired by task (final and kept versions) and called within
2 s.e. or not: that ± is over questions only, so it is outside 2 s.e. even for sync against
itself in most seeds. The `resampled` arm (sync with `sampler.seed` 2r + 1) measures how often
the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sao import stats
from sao.run_dir import RunDir

ARMS = ("grpo", "sync", "async", "resampled")
RESAMPLED_SEED = 1  # sampler.seed of the resampled arm's first repeat (the others' first repeat keeps the default, 0)
# What may differ between two runs pooled as repeats of one arm and seed: where the run lives, which tokens it draws.
REPEAT_FIELDS = {"run.run_dir", "sampler.seed"}
CODE_RECORD = "code.json"  # in each invocation's runs folder: which sao sources made its runs


def sampler_seed(arm: str, repeat: int) -> int:
    """Repeat r of an arm draws with sampler.seed 2r; the resampled arm with 2r + 1, so no two runs share draws."""
    return 2 * repeat + (RESAMPLED_SEED if arm == "resampled" else 0)


def arm_arguments(arm: str, tasks: int, group_size: int, repeat: int = 0) -> list[str]:
    """`sao run` arguments that make an arm's `repeat`; every arm produces `tasks` trajectories."""
    draws = ["--set", f"sampler.seed={sampler_seed(arm, repeat)}"] if sampler_seed(arm, repeat) else []
    if arm == "grpo":
        return ["--num-tasks", str(max(tasks // group_size, 1)), "--set", 'trainer.algorithm="grpo"',
                "--set", f"trainer.algorithm.group_size={group_size}", *draws]
    mode = ["--set", 'run.mode="sync"'] if arm in ("sync", "resampled") else []
    return ["--num-tasks", str(tasks), *mode, *draws]


def cpu_halves() -> tuple[list[int], list[int]]:
    """(sampler CPUs, trainer CPUs): the first half of this process's CPUs, and the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:len(cpus) // 2], cpus[len(cpus) // 2:]


def pinning(pinned: bool) -> list[str]:
    """Samplers on the first half of this process's CPUs, the trainer on the rest (none when unpinned)."""
    if not pinned:
        return []
    samplers, trainer = cpu_halves()
    return ["--set", f"sampler.cpu_affinity={samplers}", "--set", f"trainer.cpu_affinity={trainer}"]


def run_arm(arm: str, pinned: bool, seed: int, repeat: int, args: argparse.Namespace, runs_dir: Path) -> dict:
    run_dir = runs_dir / f"{'pinned' if pinned else 'unpinned'}-{arm}" / f"seed-{seed}{f'-r{repeat}' if repeat else ''}"
    command = [sys.executable, "-m", "sao.cli", "run", "--run-dir", str(run_dir), "--set", f"env.seed={seed}",
               "--set", f"run.heldout_cap={args.heldout_cap}",
               *arm_arguments(arm, args.tasks, args.group_size, repeat), *pinning(pinned), *args.extra]
    started = time.perf_counter()
    # Pinned, `sao run` itself starts on the samplers' CPUs, so the broker, the launcher and the feeder
    # (which inherit it) share them too and the trainer's CPUs are the trainer's alone.
    start_on = (lambda: os.sched_setaffinity(0, cpu_halves()[0])) if pinned else None
    completed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=start_on)
    if completed.returncode != 0:
        raise SystemExit(f"{run_dir.name}: sao run failed ({completed.returncode}): {completed.stderr[-3000:]}")
    figures = {"arm": arm, "pinned": pinned, "seed": seed, "repeat": repeat, "run_dir": str(run_dir),
               "wall_s": time.perf_counter() - started, **arm_figures(run_dir, synchronous=arm != "async")}
    if not args.keep_weights:  # gigabytes a run; the comparison reads summaries, status, eval and logs only
        RunDir(run_dir).drop_weights()
    return figures


def arm_figures(run_dir: Path, synchronous: bool) -> dict:
    """What the comparison reads from one run: its summary, and the step records for the steady-state rate."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = json.loads((run_dir / "status" / "trainer.json").read_text()).get("steps", [])
    trained = sum(len(step["rewards"]) for step in steps)
    span = steps[-1]["trained_at"] - steps[0]["trained_at"] if len(steps) > 1 else 0.0
    return {
        "trajectories_trained": summary.get("trajectories_trained"),
        "trajectories_per_s": summary.get("trajectories_per_s"),
        # Start-up (model loads, DeepSpeed init) is the same in every arm: the steady rate leaves it out.
        "steady_trajectories_per_s": (trained - len(steps[0]["rewards"])) / span if span > 0 else None,
        "trainer_idle_ratio": summary.get("trainer_idle_ratio"),
        "sampler_idle_ratio": summary.get("sampler_idle_ratio"),
        "staleness_mean": summary.get("staleness_mean"),
        **{key: summary.get(key) for key in ("sampling_to_training_s_p50", "sampling_to_training_s_p95",
                                             "sampling_to_training_steps_p50", "sampling_to_training_steps_p95")},
        "heldout_gain": summary.get("heldout_gain"), "heldout_gain_stderr": summary.get("heldout_gain_stderr"),
        "kept_version": summary.get("kept_version"), "heldout_kept_gain": summary.get("heldout_kept_gain"),
        "heldout_kept_gain_stderr": summary.get("heldout_kept_gain_stderr"),
        "heldout_n": summary.get("heldout_n"), "duration_s": summary.get("duration_s"),
        "trainer_steps": summary.get("trainer_steps"), **own_phases(run_dir, steps, synchronous),
    }


def own_phases(run_dir: Path, steps: list[dict], synchronous: bool) -> dict:
    """What one run's own work cost each side, per batch, and how much of its steady time that work filled.

    The arms sample with different policies after their first step, so their batches differ in turns and
    tokens: a rate ratio against the sync arm's bound mixes that work with overlap. Here S is a sampler's busy
    seconds (a live episode, reloads included) per batch, the mean over samplers; T is the trainer's step and
    publish, steady steps only. The ideal seconds per batch are S + T for a sync arm and max(S, T) for async;
    efficiency = ideal / steady seconds per batch (1: no bubble).
    """
    samplers = [json.loads(path.read_text()) for path in sorted((run_dir / "status").glob("sampler-*.json"))]
    busy = [s["run_s"] - s["idle_s"] for s in samplers if "run_s" in s and "idle_s" in s]
    if len(steps) < 2 or not busy:
        return {"sampler_busy_s": None, "trainer_busy_s": None, "batch_s": None, "efficiency": None}
    sampling = statistics.fmean(busy) / len(steps)
    training = statistics.fmean(step["step_s"] + step["publish_s"] for step in steps[1:])
    batch = (steps[-1]["trained_at"] - steps[0]["trained_at"]) / (len(steps) - 1)
    ideal = sampling + training if synchronous else max(sampling, training)
    return {"sampler_busy_s": sampling, "trainer_busy_s": training, "batch_s": batch, "efficiency": ideal / batch}


def sync_phases(run_dirs: list[Path]) -> dict:
    """S and T of the sync runs (one per seed), pooled over their batches, from the feeder's release
    times and the trainer's step records.

    A batch released for version v is exactly the trajectories with behaviour version v; its
    sampling ends when the last of them is created (trained_at - sampling_to_training_s). A run's
    first batch is released while the processes still start up, so, like the steady rate, S and T
    leave it out when there are others.
    """
    sampling: list[float] = []
    training: list[float] = []
    for run_dir in run_dirs:
        releases = json.loads((run_dir / "status" / "feeder.json").read_text())["releases"]
        steps = json.loads((run_dir / "status" / "trainer.json").read_text())["steps"]
        created: dict[int, list[float]] = {}
        for step in steps:
            for version, delay in zip(step["behaviour_versions"], step["sampling_to_training_s"]):
                created.setdefault(version, []).append(step["trained_at"] - delay)
        batches = [max(created[r["policy_version"]]) - r["released_at"] for r in releases
                   if r["policy_version"] in created]
        steps_s = [step["step_s"] + step["publish_s"] for step in steps]
        sampling += batches[1:] if len(batches) > 1 else batches
        training += steps_s[1:] if len(steps_s) > 1 else steps_s
    s, t = statistics.fmean(sampling), statistics.fmean(training)
    return {"S_s": s, "T_s": t, "bound": (s + t) / max(s, t), "batches": len(sampling)}


def code_digest() -> str:
    """sha256 over the sao package's Python sources (paths and bytes): runs pooled as repeats must share it,
    since a default computed in code is not in a run's config."""
    import sao

    root = Path(sao.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def comparable_config(run_dir: Path) -> dict[str, object]:
    """A run's effective config, flattened (`section.knob`), as two repeats must share it: without
    REPEAT_FIELDS, and with the feeder's in-flight cap as the feeder used it (unset means the default)."""
    from sao.config import load_config
    from sao.feeder import in_flight_cap

    config = load_config(run_dir / "config.toml", environ={})
    config.run.max_trajectories_in_flight = in_flight_cap(config)
    return {f"{section}.{knob}": value for section, knobs in config.model_dump().items()
            for knob, value in knobs.items() if f"{section}.{knob}" not in REPEAT_FIELDS}


def recorded_code(runs_dir: Path) -> str | None:
    """The code digest a runs folder's CODE_RECORD names; None where it is missing or not a JSON object."""
    try:
        record = json.loads((runs_dir / CODE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    digest = record.get("sao_source_sha256") if isinstance(record, dict) else None
    return digest if isinstance(digest, str) else None


def merged_runs(runs_dirs: list[Path], setting: str, own: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], list[str]]:
    """Runs of earlier invocations (their timestamped folders) to pool with `own` as more repeats.

    Only finished runs of this invocation's arms and seeds, from folders whose CODE_RECORD names this
    code (`code_digest`), and only where the config equals that of this invocation's run of the same
    arm and seed but for REPEAT_FIELDS. Returns (runs by arm, why each other run folder was left out).
    """
    pooled: dict[str, list[dict]] = {arm: [] for arm in own}
    left_out: list[str] = []
    this_code = code_digest()
    references = {arm: {r["seed"]: comparable_config(Path(r["run_dir"])) for r in arm_runs}
                  for arm, arm_runs in own.items()}  # each arm and seed's config, read once
    for runs_dir in runs_dirs:
        recorded = recorded_code(runs_dir)
        if recorded != this_code:
            left_out.append(f"{runs_dir}: made by other code" if recorded else f"{runs_dir}: no readable {CODE_RECORD}")
            continue
        for arm, reference in references.items():
            for run_dir in sorted((runs_dir / f"{setting}-{arm}").glob("seed-*")):
                if not (run_dir / "summary.json").exists() or not (run_dir / "config.toml").exists():
                    left_out.append(f"{run_dir}: unfinished (no summary.json or config.toml)")
                    continue
                config = comparable_config(run_dir)
                seed = config["env.seed"]
                if seed not in reference:
                    continue  # a seed this invocation did not run
                expected = reference[seed]
                differing = sorted(key for key in expected.keys() | config.keys() if expected.get(key) != config.get(key))
                if differing:
                    left_out.append(f"{run_dir}: config differs in {', '.join(differing)}")
                    continue
                pooled[arm].append({"arm": arm, "pinned": setting == "pinned", "seed": seed, "repeat": None,
                                    "merged": True, "run_dir": str(run_dir), "wall_s": None,
                                    **arm_figures(run_dir, synchronous=arm != "async")})
    return pooled, left_out


def gains_by_seed(runs: list[dict]) -> dict[int, list[float]] | None:
    """Each seed's held-out gains, one per run; None if a run has no held-out figure."""
    if any(r["heldout_gain"] is None for r in runs):
        return None
    by_seed: dict[int, list[float]] = {}
    for r in runs:
        by_seed.setdefault(r["seed"], []).append(r["heldout_gain"])
    return by_seed


def seed_differences(a: dict[int, list[float]], s: dict[int, list[float]]) -> dict[int, float]:
    """Per seed both arms ran: async's mean gain over its runs of the seed minus sync's."""
    return {seed: statistics.fmean(a[seed]) - statistics.fmean(s[seed]) for seed in sorted(a.keys() & s.keys())}


def learning(runs: list[dict]) -> dict:
    """An arm's held-out gain: the mean over seeds of each seed's mean over its runs, its standard error
    across seeds, and the worst run."""
    by_seed = gains_by_seed(runs)
    gains = [r["heldout_gain"] for r in runs]
    if by_seed is None:
        return {"gains": gains, "gain": None, "gain_stderr_seeds": None, "worst": None, "below_zero": None}
    means = [statistics.fmean(seed_gains) for seed_gains in by_seed.values()]
    return {"gains": gains, "gain": statistics.fmean(means), "gain_stderr_seeds": stats.stderr(means),
            "worst": min(gains), "below_zero": sum(gain < 0 for gain in gains)}


def gain_difference(asynchronous: list[dict], sync: list[dict]) -> dict:
    """async - sync held-out gain, paired by seed (each arm's mean over its runs of the seed), with the error
    that applies.

    Across seeds when there are several (it holds the run's own randomness, which dominates);
    with one seed, only the error over questions of the two arms' first runs is known.
    """
    differences = list(seed_differences(gains_by_seed(asynchronous) or {}, gains_by_seed(sync) or {}).values())
    if not differences:
        return {"heldout_gain_difference": None, "heldout_gain_difference_stderr": None,
                "difference_error": None, "heldout_gains_within_2se": None}
    if len(differences) > 1:
        se, error = stats.stderr(differences), f"across {len(differences)} seeds"
    else:
        se, error = math.hypot(asynchronous[0]["heldout_gain_stderr"], sync[0]["heldout_gain_stderr"]), \
            "over questions, one seed (the run-to-run spread is not in it)"
    difference = statistics.fmean(differences)
    return {"heldout_gain_difference": difference, "heldout_gain_difference_stderr": se, "difference_error": error,
            "heldout_gain_differences": differences, "heldout_gains_within_2se": abs(difference) <= 2 * se}


def seed_learning(asynchronous: list[dict], sync: list[dict]) -> dict:
    """Each seed's async - sync held-out gain (means over each arm's runs of it) against the run-to-run spread.

    Each arm's run-to-run variance is pooled over seeds (squared deviations from each seed's own mean
    over n - 1 per seed degrees of freedom): a few repeats of one seed cannot estimate it on their own.
    A seed's difference has s.e. sqrt(var_async / n_async + var_sync / n_sync) and is within 2 s.e.,
    or behind (async lower by more), or ahead. No arm with two runs of a seed: no verdict.
    """
    a, s = gains_by_seed(asynchronous), gains_by_seed(sync)
    if a is None or s is None:
        return {"rows": [], "run_sd": {"async": None, "sync": None}, "outside": None, "behind": None}
    variance = {"async": stats.pooled_variance(list(a.values())), "sync": stats.pooled_variance(list(s.values()))}
    rows = []
    for seed, difference in seed_differences(a, s).items():
        se = (math.sqrt(variance["async"] / len(a[seed]) + variance["sync"] / len(s[seed]))
              if None not in variance.values() else None)
        rows.append({"seed": seed, "async_runs": len(a[seed]), "sync_runs": len(s[seed]),
                     "async_gain": statistics.fmean(a[seed]), "sync_gain": statistics.fmean(s[seed]),
                     "difference": difference, "stderr": se,
                     "within_2se": None if se is None else abs(difference) <= 2 * se,
                     "behind_2se": None if se is None else difference < -2 * se})
    judged = [row for row in rows if row["stderr"] is not None]
    return {"rows": rows, "run_sd": {arm: None if v is None else math.sqrt(v) for arm, v in variance.items()},
            "outside": sum(not row["within_2se"] for row in judged) if judged else None,
            "behind": sum(row["behind_2se"] for row in judged) if judged else None}


def paired_by_task(async_dir: Path, sync_dir: Path, which: str) -> tuple[float | None, float | None, int]:
    """async - sync first-try success of one version (`final` or `kept`) on the held-out tasks both
    runs scored, paired by task: (mean difference, its standard error, n)."""
    def first_tries(run_dir: Path) -> dict[str, float]:
        path = run_dir / "eval" / "heldout.json"
        per_task = json.loads(path.read_text()).get("per_task", {}) if path.exists() else {}
        return {task: scores[which]["first_try"] for task, scores in per_task.items() if which in scores}

    a, s = first_tries(async_dir), first_tries(sync_dir)
    differences = [a[task] - s[task] for task in a if task in s]
    return stats.mean(differences), stats.stderr(differences), len(differences)


def paired_versions(run: dict, against: dict) -> dict:
    """run - against held-out success of the final and the kept versions, paired by task, within 2 s.e. or not."""
    paired = {}
    for which in ("final", "kept"):
        difference, se, n = paired_by_task(Path(run["run_dir"]), Path(against["run_dir"]), which)
        paired[which] = {"difference": difference, "stderr": se, "n": n,
                         "within_2se": None if difference is None or se is None else abs(difference) <= 2 * se}
    return paired


def runs_of(runs: dict[str, list[dict]], arm: str, seed: int) -> list[dict]:
    """An arm's runs of one seed, in the order they ran."""
    return [r for r in runs.get(arm, []) if r["seed"] == seed]


def per_seed(runs: dict[str, list[dict]]) -> list[dict]:
    """Each pair of runs of a seed (the i-th async with the i-th sync run of it): async / sync steady rate
    against that pair's bound, async - sync held-out success paired by task (final and kept versions), and
    with the resampled arm resampled - sync the same way."""
    rows = []
    for seed in dict.fromkeys(r["seed"] for r in runs["async"]):
        resampled = runs_of(runs, "resampled", seed)
        for index, (a, s) in enumerate(zip(runs_of(runs, "async", seed), runs_of(runs, "sync", seed))):
            phases = sync_phases([Path(s["run_dir"])])
            ratio = (a["steady_trajectories_per_s"] / s["steady_trajectories_per_s"]
                     if a["steady_trajectories_per_s"] and s["steady_trajectories_per_s"] else None)
            row = {"seed": seed, "pair": index, "ratio": ratio, "bound": phases["bound"],
                   "ratio_of_bound": ratio / phases["bound"] if ratio else None, **work_matched(a, s),
                   **paired_versions(a, s)}
            if index < len(resampled):
                row["resampled"] = paired_versions(resampled[index], s)
            rows.append(row)
    return rows


def seed_rates(runs: dict[str, list[dict]]) -> list[dict]:
    """Each seed's async / sync steady rate over all its runs (mean rate of each arm) against the bound from all
    its sync runs' batches: the throughput counterpart of `seed_learning`, where one run pair's ratio moves with
    what its two policies happened to sample."""
    rows = []
    for seed in dict.fromkeys(r["seed"] for r in runs["async"]):
        a = [r["steady_trajectories_per_s"] for r in runs_of(runs, "async", seed)]
        s = runs_of(runs, "sync", seed)
        if not s or None in a or any(r["steady_trajectories_per_s"] is None for r in s):
            continue
        ratio = statistics.fmean(a) / statistics.fmean(r["steady_trajectories_per_s"] for r in s)
        bound = sync_phases([Path(r["run_dir"]) for r in s])["bound"]
        rows.append({"seed": seed, "async_runs": len(a), "sync_runs": len(s), "ratio": ratio, "bound": bound,
                     "ratio_of_bound": ratio / bound})
    return rows


def work_matched(asynchronous: dict, sync: dict) -> dict:
    """The bound from each arm's own work: sync's S + T over async's max(S, T). The rate ratio over it is
    async's efficiency over sync's (see `own_phases`)."""
    keys = ("sampler_busy_s", "trainer_busy_s")
    efficiencies = {"async_efficiency": asynchronous.get("efficiency"), "sync_efficiency": sync.get("efficiency")}
    if any(run.get(key) is None for run in (asynchronous, sync) for key in keys):
        return {"work_bound": None, "ratio_of_work_bound": None, **efficiencies}
    bound = (sync["sampler_busy_s"] + sync["trainer_busy_s"]) / max(asynchronous[key] for key in keys)
    return {"work_bound": bound, "ratio_of_work_bound": asynchronous["efficiency"] / sync["efficiency"], **efficiencies}


def outside_2se(rows: list[dict], key: str | None = None) -> dict:
    """How many run pairs' difference by task (async - sync; with `key`, that comparison's) is outside 2 s.e."""
    counts = {}
    for which in ("final", "kept"):
        verdicts = [(row[key] if key else row)[which]["within_2se"] for row in rows if not key or key in row]
        known = [v for v in verdicts if v is not None]
        counts[which] = {"outside": sum(not v for v in known), "pairs": len(known)}
    return counts


def compare(runs: dict[str, list[dict]], phases: dict) -> dict:
    """async / sync over seeds: mean rates against the bound, and whether both learned as much."""
    def rate(arm: str, key: str) -> float | None:
        return stats.mean([r[key] for r in runs[arm]])

    value, baseline = rate("async", "steady_trajectories_per_s"), rate("sync", "steady_trajectories_per_s")
    ratio = value / baseline if value and baseline else None
    whole_async, whole_sync = rate("async", "trajectories_per_s"), rate("sync", "trajectories_per_s")
    return {"value": value, "baseline": baseline, "ratio": ratio,
            "ratio_whole_run": whole_async / whole_sync if whole_async and whole_sync else None, **phases,
            "ratio_of_bound": ratio / phases["bound"] if ratio else None,
            "learning": {arm: learning(arm_runs) for arm, arm_runs in runs.items()},
            **gain_difference(runs["async"], runs["sync"]), "seed_learning": seed_learning(runs["async"], runs["sync"]),
            "per_seed": (rows := per_seed(runs)), "seed_rates": seed_rates(runs),
            "async_outside_2se": outside_2se(rows),
            **({"resampled_outside_2se": outside_2se(rows, "resampled")} if runs.get("resampled") else {})}


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=48, help="trajectories per arm (grpo: tasks / group-size tasks)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="env.seed of each run (the tasks)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every arm per seed, repeat r with sampler.seed 2r (resampled: 2r + 1)")
    parser.add_argument("--merge", type=Path, nargs="+", default=[], metavar="RUNS_DIR",
                        help="timestamped runs folders of earlier invocations: their finished runs of these arms and "
                             "seeds whose config matches count as more repeats")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS[:3]),
                        help="arms to run (sync and async are always among them: the headline compares them; "
                             "resampled only when named)")
    parser.add_argument("--heldout-cap", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8, help="GRPO copies per task (divides the batch)")
    compute = parser.add_mutually_exclusive_group()
    compute.add_argument("--pinned", dest="compute", action="store_const", const=("pinned",))
    compute.add_argument("--unpinned", dest="compute", action="store_const", const=("unpinned",))
    compute.add_argument("--both", dest="compute", action="store_const", const=("unpinned", "pinned"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/bench/async_vs_sync"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep each run's checkpoints, policy files and optimizer snapshots (deleted once its "
                             "figures are read)")
    parser.add_argument("extra", nargs="*", help="arguments passed on to every `sao run` (after --)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    settings = args.compute or ("unpinned", "pinned")
    arms = [arm for arm in ARMS if arm in {*args.arms, "sync", "async"}]
    if "pinned" in settings and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("pinning needs at least 2 CPUs (samplers on one, the trainer on another); use --unpinned")

    from rich.console import Console
    from rich.table import Table

    console = Console()
    runs_dir = args.runs_dir / time.strftime("%Y%m%d-%H%M%S")
    runs_dir.mkdir(parents=True, exist_ok=True)
    (runs_dir / CODE_RECORD).write_text(json.dumps({"sao_source_sha256": code_digest()}))
    results: dict[str, dict] = {}
    for setting in settings:
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for seed in args.seeds:  # seed by seed, so a stopped benchmark has whole seeds
            for repeat in range(args.repeats):
                for arm in arms:
                    runs[arm].append(run_arm(arm, setting == "pinned", seed, repeat, args, runs_dir))
        if args.merge:
            pooled, left_out = merged_runs(args.merge, setting, runs)
            for reason in left_out:
                console.print(f"{setting}: not pooled: {reason}")
            for arm in arms:
                runs[arm] = sorted(runs[arm] + pooled[arm], key=lambda r: r["seed"])  # stable: own runs first
        phases = sync_phases([Path(r["run_dir"]) for r in runs["sync"]])
        results[setting] = {"arms": runs, **compare(runs, phases)}

    table = Table(title=f"{args.tasks} trajectories per arm, seeds {args.seeds}, {len(os.sched_getaffinity(0))} CPUs")
    for column in ("compute", "arm", "seed", "repeat", "traj/s steady", "traj/s run", "trainer idle", "sampler idle", "staleness",
                   "delay s p50/p95", "delay steps p50/p95", "held-out gain ± s.e.", "n", "wall s"):
        table.add_column(column, justify="right")
    for setting, result in results.items():
        for r in (r for arm in arms for r in result["arms"][arm]):
            arm = r["arm"]
            table.add_row(setting, arm, str(r["seed"]), "merged" if r.get("merged") else str(r["repeat"]),
                          _fmt(r["steady_trajectories_per_s"]),
                          _fmt(r["trajectories_per_s"]),
                          _fmt(r["trainer_idle_ratio"], ".2f"), _fmt(r["sampler_idle_ratio"], ".2f"),
                          _fmt(r["staleness_mean"], ".2f"),
                          f"{_fmt(r['sampling_to_training_s_p50'], '.1f')}/{_fmt(r['sampling_to_training_s_p95'], '.1f')}",
                          f"{_fmt(r['sampling_to_training_steps_p50'], '.1f')}/"
                          f"{_fmt(r['sampling_to_training_steps_p95'], '.1f')}",
                          f"{_fmt(r['heldout_gain'], '+.3f')} ± {_fmt(r['heldout_gain_stderr'])}",
                          _fmt(r["heldout_n"], "d"), _fmt(r["wall_s"], ".0f"),
                          end_section=arm == arms[-1] and r is result["arms"][arm][-1])
    console.print(table)
    for setting, r in results.items():
        console.print(f"{setting}: async / sync {_fmt(r['ratio'], '.2f')}x steady ({_fmt(r['ratio_whole_run'], '.2f')}x "
                      f"over the whole run); sync S = {r['S_s']:.1f} s, T = {r['T_s']:.1f} s, bound (S+T)/max(S,T) = "
                      f"{r['bound']:.2f}x; ratio / bound = {_fmt(r['ratio_of_bound'], '.2f')}")
        for row in r["per_seed"]:
            versions = "; ".join(
                f"{which} async - sync {_fmt(row[which]['difference'], '+.3f')} ± {_fmt(row[which]['stderr'])} "
                f"(n {row[which]['n']}, {'within' if row[which]['within_2se'] else 'NOT within'} 2 s.e.)"
                for which in ("final", "kept") if row[which]["n"])
            console.print(f"{setting}: seed {row['seed']} pair {row['pair']}: async / sync {_fmt(row['ratio'], '.2f')}x, bound "
                          f"{row['bound']:.2f}x, ratio / bound {_fmt(row['ratio_of_bound'], '.2f')}; each arm's own "
                          f"work: bound {_fmt(row['work_bound'], '.2f')}x, ratio / bound "
                          f"{_fmt(row['ratio_of_work_bound'], '.2f')} (efficiency async "
                          f"{_fmt(row['async_efficiency'], '.2f')}, sync {_fmt(row['sync_efficiency'], '.2f')})"
                          f"; {versions}")
            if "resampled" in row:
                console.print(f"{setting}: seed {row['seed']} pair {row['pair']}: sync against itself, " + "; ".join(
                    f"{which} resampled - sync {_fmt(row['resampled'][which]['difference'], '+.3f')} ± "
                    f"{_fmt(row['resampled'][which]['stderr'])} ("
                    f"{'within' if row['resampled'][which]['within_2se'] else 'NOT within'} 2 s.e.)"
                    for which in ("final", "kept") if row["resampled"][which]["n"]))
        for row in r["seed_rates"]:
            console.print(f"{setting}: seed {row['seed']}, all its runs ({row['async_runs']} async, {row['sync_runs']} "
                          f"sync): async / sync {row['ratio']:.2f}x, bound {row['bound']:.2f}x, ratio / bound "
                          f"{row['ratio_of_bound']:.2f}")
        for label, key in (("async - sync", "async_outside_2se"), ("resampled - sync", "resampled_outside_2se")):
            if key in r:
                console.print(f"{setting}: {label} by task (over questions only) outside 2 s.e. in " + ", ".join(
                    f"{c['outside']} of {c['pairs']} run pairs ({which})" for which, c in r[key].items()))
        if r["heldout_gains_within_2se"] is None:
            console.print(f"{setting}: no held-out figures (run.heldout_eval off?): learning not compared")
            continue
        for arm, learned in r["learning"].items():
            console.print(f"{setting}: {arm} held-out gain {learned['gain']:+.3f} ± "
                          f"{_fmt(learned['gain_stderr_seeds'])} across seeds ({len(learned['gains'])} runs; worst "
                          f"{learned['worst']:+.3f}, {learned['below_zero']} below 0)")
        by_seed = r["seed_learning"]
        if by_seed["outside"] is None:
            console.print(f"{setting}: per seed: one run an arm and seed, so no run-to-run spread to judge a seed "
                          "against (--repeats 2 or --merge)")
        else:
            console.print(f"{setting}: run-to-run sd of the held-out gain, pooled over seeds: async "
                          f"{_fmt(by_seed['run_sd']['async'])}, sync {_fmt(by_seed['run_sd']['sync'])}")
            for row in by_seed["rows"]:
                verdict = "within 2 s.e." if row["within_2se"] else ("BEHIND by > 2 s.e." if row["behind_2se"]
                                                                     else "ahead by > 2 s.e.")
                console.print(f"{setting}: seed {row['seed']}: async {row['async_gain']:+.3f} ({row['async_runs']} "
                              f"runs), sync {row['sync_gain']:+.3f} ({row['sync_runs']}): async - sync "
                              f"{row['difference']:+.3f} ± {row['stderr']:.3f}, {verdict}")
            console.print(f"{setting}: per seed against the run-to-run spread, async outside 2 s.e. in "
                          f"{by_seed['outside']} of {len(by_seed['rows'])} seeds, behind in {by_seed['behind']}")
        console.print(f"{setting}: held-out gain async - sync = {r['heldout_gain_difference']:+.3f} ± "
                      f"{r['heldout_gain_difference_stderr']:.3f} ({r['difference_error']}): "
                      + ("within 2 s.e." if r["heldout_gains_within_2se"] else "NOT within 2 s.e."))
    if args.json:
        headline_setting = "pinned" if "pinned" in results else "unpinned"
        head = results[headline_setting]
        args.json.write_text(json.dumps({
            "headline": {"metric": f"async / sync single-trajectory trajectories per second, {headline_setting}",
                         "unit": "trajectories/s", "value": head["value"], "baseline": head["baseline"],
                         "ratio": head["ratio"], "bound": head["bound"], "ratio_of_bound": head["ratio_of_bound"],
                         "rate": "steady state: trajectories trained after the first step / seconds from the "
                                 "first step to the last"},
            "heldout_gains_within_2se": head["heldout_gains_within_2se"],
            "difference_error": head["difference_error"],
            "seeds_async_behind_2se": head["seed_learning"]["behind"],
            "results": results, "tasks": args.tasks, "seeds": args.seeds, "repeats": args.repeats,
            "merged": [str(path) for path in args.merge], "arms": arms, "group_size": args.group_size,
            "cpus": sorted(os.sched_getaffinity(0)), "extra": args.extra, "runs_dir": str(runs_dir)}, indent=2))


if __name__ == "__main__":
    main()
