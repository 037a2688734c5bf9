"""Async vs sync: sao's asynchronous default against synchronous training, same env, model, tasks, seeds and compute.

    python benchmarks/async_vs_sync.py [--tasks 48] [--seeds 0 1 2] [--arms grpo sync async resampled]
        [--heldout-cap 128] [--group-size 8] [--pinned | --unpinned | --both] [--runs-dir runs/bench/async_vs_sync]
        [--json PATH] [--keep-weights]
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

Learning: one run of an arm moves its held-out gain by up to 0.5 between seeds (the run's own
randomness: which version samples which task), far more than the ± over questions of one run. So
each arm runs once per seed (`--seeds`), and "async learns as much as sync" is judged on the paired
per-seed difference async - sync, its mean ± the standard error across seeds; with one seed only
the error over questions is left, and the JSON says so (`difference_error`). Rates are averaged
over seeds the same way (the headline: mean async rate / mean sync rate).

Per seed, async - sync is also paired by task (final and kept versions) and called within 2 s.e.
or not. A sync run repeats itself given its seed, while async's timing draws anew each run, so a
per-seed gap holds the run's own randomness too; the `resampled` arm measures how often sync
against sync with other draws falls outside 2 s.e. the same way: the floor a per-seed verdict on
async is read against.
"""

from __future__ import annotations

import argparse
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
RESAMPLED_SEED = 1  # sampler.seed of the resampled arm (the others keep the default, 0)


def arm_arguments(arm: str, tasks: int, group_size: int) -> list[str]:
    """`sao run` arguments that make an arm; every arm produces `tasks` trajectories."""
    if arm == "grpo":
        return ["--num-tasks", str(max(tasks // group_size, 1)), "--set", 'trainer.algorithm="grpo"',
                "--set", f"trainer.group_size={group_size}"]
    mode = ["--set", 'run.mode="sync"'] if arm in ("sync", "resampled") else []
    draws = ["--set", f"sampler.seed={RESAMPLED_SEED}"] if arm == "resampled" else []
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


def run_arm(arm: str, pinned: bool, seed: int, args: argparse.Namespace, runs_dir: Path) -> dict:
    run_dir = runs_dir / f"{'pinned' if pinned else 'unpinned'}-{arm}" / f"seed-{seed}"
    command = [sys.executable, "-m", "sao.cli", "run", "--run-dir", str(run_dir), "--set", f"env.seed={seed}",
               "--set", f"run.heldout_cap={args.heldout_cap}", *arm_arguments(arm, args.tasks, args.group_size),
               *pinning(pinned), *args.extra]
    started = time.perf_counter()
    # Pinned, `sao run` itself starts on the samplers' CPUs, so the broker, the launcher and the feeder
    # (which inherit it) share them too and the trainer's CPUs are the trainer's alone.
    start_on = (lambda: os.sched_setaffinity(0, cpu_halves()[0])) if pinned else None
    completed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=start_on)
    if completed.returncode != 0:
        raise SystemExit(f"{run_dir.name}: sao run failed ({completed.returncode}): {completed.stderr[-3000:]}")
    figures = {"arm": arm, "pinned": pinned, "seed": seed, "run_dir": str(run_dir),
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


def learning(runs: list[dict]) -> dict:
    """An arm's held-out gain over seeds: the mean, and its standard error across seeds."""
    gains = [r["heldout_gain"] for r in runs]
    if None in gains:
        return {"gains": gains, "gain": None, "gain_stderr_seeds": None}
    return {"gains": gains, "gain": statistics.fmean(gains), "gain_stderr_seeds": stats.stderr(gains)}


def gain_difference(asynchronous: list[dict], sync: list[dict]) -> dict:
    """async - sync held-out gain, paired by seed, with the error that applies.

    Across seeds when there are several (it holds the run's own randomness, which dominates);
    with one seed, only the error over questions of the two runs is known.
    """
    pairs = [(a["heldout_gain"], s["heldout_gain"]) for a, s in zip(asynchronous, sync)]
    if not pairs or any(None in pair for pair in pairs):
        return {"heldout_gain_difference": None, "heldout_gain_difference_stderr": None,
                "difference_error": None, "heldout_gains_within_2se": None}
    differences = [a - s for a, s in pairs]
    if len(differences) > 1:
        se, error = stats.stderr(differences), f"across {len(differences)} seeds"
    else:
        se, error = math.hypot(asynchronous[0]["heldout_gain_stderr"], sync[0]["heldout_gain_stderr"]), \
            "over questions, one seed (the run-to-run spread is not in it)"
    difference = statistics.fmean(differences)
    return {"heldout_gain_difference": difference, "heldout_gain_difference_stderr": se, "difference_error": error,
            "heldout_gain_differences": differences, "heldout_gains_within_2se": abs(difference) <= 2 * se}


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


def per_seed(runs: dict[str, list[dict]]) -> list[dict]:
    """Each seed on its own: async / sync steady rate against that seed's bound, async - sync held-out
    success paired by task (final and kept versions), and with the resampled arm resampled - sync the same way."""
    rows = []
    for index, (a, s) in enumerate(zip(runs["async"], runs["sync"])):
        phases = sync_phases([Path(s["run_dir"])])
        ratio = (a["steady_trajectories_per_s"] / s["steady_trajectories_per_s"]
                 if a["steady_trajectories_per_s"] and s["steady_trajectories_per_s"] else None)
        row = {"seed": a["seed"], "ratio": ratio, "bound": phases["bound"],
               "ratio_of_bound": ratio / phases["bound"] if ratio else None, **work_matched(a, s),
               **paired_versions(a, s)}
        if runs.get("resampled"):
            row["resampled"] = paired_versions(runs["resampled"][index], s)
        rows.append(row)
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
    """How many seeds' paired difference (async - sync; with `key`, that comparison's) is outside 2 s.e."""
    counts = {}
    for which in ("final", "kept"):
        verdicts = [(row[key] if key else row)[which]["within_2se"] for row in rows if not key or key in row]
        known = [v for v in verdicts if v is not None]
        counts[which] = {"outside": sum(not v for v in known), "seeds": len(known)}
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
            **gain_difference(runs["async"], runs["sync"]), "per_seed": (rows := per_seed(runs)),
            "async_outside_2se": outside_2se(rows),
            **({"resampled_outside_2se": outside_2se(rows, "resampled")} if runs.get("resampled") else {})}


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=48, help="trajectories per arm (grpo: tasks / group-size tasks)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of every arm per seed")
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
    settings = args.compute or ("unpinned", "pinned")
    arms = [arm for arm in ARMS if arm in {*args.arms, "sync", "async"}]
    if "pinned" in settings and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("pinning needs at least 2 CPUs (samplers on one, the trainer on another); use --unpinned")

    from rich.console import Console
    from rich.table import Table

    console = Console()
    runs_dir = args.runs_dir / time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict] = {}
    for setting in settings:
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for seed in args.seeds:  # seed by seed, so a stopped benchmark has whole seeds
            for arm in arms:
                runs[arm].append(run_arm(arm, setting == "pinned", seed, args, runs_dir))
        phases = sync_phases([Path(r["run_dir"]) for r in runs["sync"]])
        results[setting] = {"arms": runs, **compare(runs, phases)}

    table = Table(title=f"{args.tasks} trajectories per arm, seeds {args.seeds}, {len(os.sched_getaffinity(0))} CPUs")
    for column in ("compute", "arm", "seed", "traj/s steady", "traj/s run", "trainer idle", "sampler idle", "staleness",
                   "delay s p50/p95", "delay steps p50/p95", "held-out gain ± s.e.", "n", "wall s"):
        table.add_column(column, justify="right")
    for setting, result in results.items():
        for r in (r for arm in arms for r in result["arms"][arm]):
            arm = r["arm"]
            table.add_row(setting, arm, str(r["seed"]), _fmt(r["steady_trajectories_per_s"]),
                          _fmt(r["trajectories_per_s"]),
                          _fmt(r["trainer_idle_ratio"], ".2f"), _fmt(r["sampler_idle_ratio"], ".2f"),
                          _fmt(r["staleness_mean"], ".2f"),
                          f"{_fmt(r['sampling_to_training_s_p50'], '.1f')}/{_fmt(r['sampling_to_training_s_p95'], '.1f')}",
                          f"{_fmt(r['sampling_to_training_steps_p50'], '.1f')}/"
                          f"{_fmt(r['sampling_to_training_steps_p95'], '.1f')}",
                          f"{_fmt(r['heldout_gain'], '+.3f')} ± {_fmt(r['heldout_gain_stderr'])}",
                          _fmt(r["heldout_n"], "d"), f"{r['wall_s']:.0f}",
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
            console.print(f"{setting}: seed {row['seed']}: async / sync {_fmt(row['ratio'], '.2f')}x, bound "
                          f"{row['bound']:.2f}x, ratio / bound {_fmt(row['ratio_of_bound'], '.2f')}; each arm's own "
                          f"work: bound {_fmt(row['work_bound'], '.2f')}x, ratio / bound "
                          f"{_fmt(row['ratio_of_work_bound'], '.2f')} (efficiency async "
                          f"{_fmt(row['async_efficiency'], '.2f')}, sync {_fmt(row['sync_efficiency'], '.2f')})"
                          f"; {versions}")
            if "resampled" in row:
                console.print(f"{setting}: seed {row['seed']}: sync against itself, " + "; ".join(
                    f"{which} resampled - sync {_fmt(row['resampled'][which]['difference'], '+.3f')} ± "
                    f"{_fmt(row['resampled'][which]['stderr'])} ("
                    f"{'within' if row['resampled'][which]['within_2se'] else 'NOT within'} 2 s.e.)"
                    for which in ("final", "kept") if row["resampled"][which]["n"]))
        for label, key in (("async - sync", "async_outside_2se"), ("resampled - sync", "resampled_outside_2se")):
            if key in r:
                console.print(f"{setting}: {label} outside 2 s.e. in " + ", ".join(
                    f"{c['outside']} of {c['seeds']} seeds ({which})" for which, c in r[key].items()))
        if r["heldout_gains_within_2se"] is None:
            console.print(f"{setting}: no held-out figures (run.heldout_eval off?): learning not compared")
            continue
        for arm, learned in r["learning"].items():
            console.print(f"{setting}: {arm} held-out gain {learned['gain']:+.3f} ± "
                          f"{_fmt(learned['gain_stderr_seeds'])} across {len(learned['gains'])} seed(s)")
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
            "results": results, "tasks": args.tasks, "seeds": args.seeds, "arms": arms, "group_size": args.group_size,
            "cpus": sorted(os.sched_getaffinity(0)), "extra": args.extra, "runs_dir": str(runs_dir)}, indent=2))


if __name__ == "__main__":
    main()
