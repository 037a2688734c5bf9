"""Async vs sync: sao's asynchronous default against synchronous training, same env, model, tasks, seed and compute.

    python benchmarks/async_vs_sync.py [--tasks 48] [--seed 0] [--heldout-cap 128] [--group-size 8]
        [--pinned | --unpinned | --both] [--runs-dir runs/bench/async_vs_sync] [--json PATH] [-- extra sao run args]

Three arms, each one `sao run` (its own run directory) on the same number of trajectories:
(a) synchronous GRPO, `--group-size` attempts per task (tasks / group-size tasks); (b) synchronous
single-trajectory, `run.mode = "sync"`: one batch released, sampled with the newest version, trained
and published before the next; (c) sao's asynchronous default. Each arm runs unpinned (the OS
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

ARMS = ("grpo", "sync", "async")


def arm_arguments(arm: str, tasks: int, group_size: int) -> list[str]:
    """`sao run` arguments that make an arm; every arm produces `tasks` trajectories."""
    if arm == "grpo":
        return ["--num-tasks", str(max(tasks // group_size, 1)), "--set", 'trainer.algorithm="grpo"',
                "--set", f"trainer.group_size={group_size}"]
    mode = ["--set", 'run.mode="sync"'] if arm == "sync" else []
    return ["--num-tasks", str(tasks), *mode]


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


def run_arm(arm: str, pinned: bool, args: argparse.Namespace, runs_dir: Path) -> dict:
    run_dir = runs_dir / f"{'pinned' if pinned else 'unpinned'}-{arm}"
    command = [sys.executable, "-m", "sao.cli", "run", "--run-dir", str(run_dir), "--set", f"env.seed={args.seed}",
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
    return {"arm": arm, "pinned": pinned, "run_dir": str(run_dir), "wall_s": time.perf_counter() - started,
            **arm_figures(run_dir)}


def arm_figures(run_dir: Path) -> dict:
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
        "heldout_n": summary.get("heldout_n"), "duration_s": summary.get("duration_s"),
        "trainer_steps": summary.get("trainer_steps"),
    }


def sync_phases(run_dir: Path) -> dict:
    """S and T of a sync run, from the feeder's release times and the trainer's step records.

    A batch released for version v is exactly the trajectories with behaviour version v; its
    sampling ends when the last of them is created (trained_at - sampling_to_training_s). The first
    batch is released while the processes still start up, so, like the steady rate, S and T leave
    it out when there are others.
    """
    releases = json.loads((run_dir / "status" / "feeder.json").read_text())["releases"]
    steps = json.loads((run_dir / "status" / "trainer.json").read_text())["steps"]
    created: dict[int, list[float]] = {}
    for step in steps:
        for version, delay in zip(step["behaviour_versions"], step["sampling_to_training_s"]):
            created.setdefault(version, []).append(step["trained_at"] - delay)
    sampling = [max(created[r["policy_version"]]) - r["released_at"] for r in releases if r["policy_version"] in created]
    training = [step["step_s"] + step["publish_s"] for step in steps]
    sampling, training = (sampling[1:], training[1:]) if len(sampling) > 1 and len(training) > 1 else (sampling, training)
    s, t = statistics.fmean(sampling), statistics.fmean(training)
    return {"S_s": s, "T_s": t, "bound": (s + t) / max(s, t), "batches": len(sampling)}


def compare(runs: dict[str, dict], phases: dict) -> dict:
    """async / sync rates against the bound, and whether both learned as much (within 2 s.e.)."""
    sync, asynchronous = runs["sync"], runs["async"]
    value, baseline = asynchronous["steady_trajectories_per_s"], sync["steady_trajectories_per_s"]
    ratio = value / baseline if value and baseline else None
    whole = (asynchronous["trajectories_per_s"] / sync["trajectories_per_s"]
             if asynchronous["trajectories_per_s"] and sync["trajectories_per_s"] else None)
    gains = (asynchronous["heldout_gain"], sync["heldout_gain"])
    errors = (asynchronous["heldout_gain_stderr"], sync["heldout_gain_stderr"])
    difference = se = within = None
    if None not in gains and None not in errors:
        difference, se = gains[0] - gains[1], math.hypot(*errors)
        within = abs(difference) <= 2 * se
    return {"value": value, "baseline": baseline, "ratio": ratio, "ratio_whole_run": whole, **phases,
            "ratio_of_bound": ratio / phases["bound"] if ratio else None,
            "heldout_gain_difference": difference, "heldout_gain_difference_stderr": se,
            "heldout_gains_within_2se": within}


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=48, help="trajectories per arm (grpo: tasks / group-size tasks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-cap", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8, help="GRPO attempts per task (divides the batch)")
    compute = parser.add_mutually_exclusive_group()
    compute.add_argument("--pinned", dest="compute", action="store_const", const=("pinned",))
    compute.add_argument("--unpinned", dest="compute", action="store_const", const=("unpinned",))
    compute.add_argument("--both", dest="compute", action="store_const", const=("unpinned", "pinned"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/bench/async_vs_sync"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("extra", nargs="*", help="arguments passed on to every `sao run` (after --)")
    args = parser.parse_args()
    settings = args.compute or ("unpinned", "pinned")
    if "pinned" in settings and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("pinning needs at least 2 CPUs (samplers on one, the trainer on another); use --unpinned")

    from rich.console import Console
    from rich.table import Table

    console = Console()
    runs_dir = args.runs_dir / time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict] = {}
    for setting in settings:
        runs = {arm: run_arm(arm, setting == "pinned", args, runs_dir) for arm in ARMS}
        results[setting] = {"arms": runs, **compare(runs, sync_phases(Path(runs["sync"]["run_dir"])))}

    table = Table(title=f"{args.tasks} trajectories per arm, seed {args.seed}, {len(os.sched_getaffinity(0))} CPUs")
    for column in ("compute", "arm", "traj/s steady", "traj/s run", "trainer idle", "sampler idle", "staleness",
                   "delay s p50/p95", "delay steps p50/p95", "held-out gain ± s.e.", "n", "wall s"):
        table.add_column(column, justify="right")
    for setting, result in results.items():
        for arm, r in result["arms"].items():
            table.add_row(setting, arm, _fmt(r["steady_trajectories_per_s"]), _fmt(r["trajectories_per_s"]),
                          _fmt(r["trainer_idle_ratio"], ".2f"), _fmt(r["sampler_idle_ratio"], ".2f"),
                          _fmt(r["staleness_mean"], ".2f"),
                          f"{_fmt(r['sampling_to_training_s_p50'], '.1f')}/{_fmt(r['sampling_to_training_s_p95'], '.1f')}",
                          f"{_fmt(r['sampling_to_training_steps_p50'], '.1f')}/"
                          f"{_fmt(r['sampling_to_training_steps_p95'], '.1f')}",
                          f"{_fmt(r['heldout_gain'], '+.3f')} ± {_fmt(r['heldout_gain_stderr'])}",
                          _fmt(r["heldout_n"], "d"), f"{r['wall_s']:.0f}", end_section=arm == ARMS[-1])
    console.print(table)
    for setting, r in results.items():
        console.print(f"{setting}: async / sync {_fmt(r['ratio'], '.2f')}x steady ({_fmt(r['ratio_whole_run'], '.2f')}x "
                      f"over the whole run); sync S = {r['S_s']:.1f} s, T = {r['T_s']:.1f} s, bound (S+T)/max(S,T) = "
                      f"{r['bound']:.2f}x; ratio / bound = {_fmt(r['ratio_of_bound'], '.2f')}")
        if r["heldout_gains_within_2se"] is None:
            console.print(f"{setting}: no held-out figures (run.heldout_eval off?): learning not compared")
        else:
            console.print(f"{setting}: held-out gain async - sync = {r['heldout_gain_difference']:+.3f} ± "
                          f"{r['heldout_gain_difference_stderr']:.3f}: "
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
            "results": results, "tasks": args.tasks, "seed": args.seed, "group_size": args.group_size,
            "cpus": sorted(os.sched_getaffinity(0)), "extra": args.extra, "runs_dir": str(runs_dir)}, indent=2))


if __name__ == "__main__":
    main()
