"""Does the default run learn? `sao run` once per seed; held-out first-try success before vs after.

    python benchmarks/learning.py [--seeds 0 1 2] [--contended 2] [--runs-dir runs/learning] [--json PATH]
                                  [--keep-weights] [-- extra sao run args]

Each seed is a whole default run (`env.seed` changes the training stream; everything else is the
default config unless extra arguments follow `--`). Each run ends by scoring the base model and
its final version, greedily, on the same held-out tasks it never trained on (`run.heldout_*`);
from each summary.json this prints their first-try success, the paired gain with its standard
error over tasks, each one's second-try success after a wrong first answer (not paired: each over
its own failures) and the share of those retries the env penalised for giving no new answer, the
sampled reward of the first and last behaviour versions, and the wall time.
Over seeds it prints the mean gain with two standard errors: across seeds (sd of the per-seed
gains / sqrt(seeds): the run's own randomness) and over tasks (sqrt(sum of squared per-seed
errors) / seeds). Every seed is scored on the same held-out tasks, so the task error does not
shrink with more seeds; the base model's scores come from the held-out cache after the first run.
Second tries over seeds: their mean with its error across seeds, and how many seeds beat the base.
The JSON keeps each run's steps (`step_signals`: reward, grad norm, KL to the behaviour policy and,
with `trainer.measure_kl_to_base`, to the base, the sampled tokens' -log pi, the advantages' spread),
where a collapse can be traced. Runs with shadow validation also report the version it kept (best on the validation slice), its
held-out gain, drops and rollbacks. `--contended N` runs N seeds at a time, sharing the cores as
a busy machine would; the spread then matters more than the mean: the worst gain (final and kept)
and the share of runs below zero are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sao.run_dir import RunDir
from sao.stats import mean, stderr

KEYS = ("heldout_base", "heldout_final", "heldout_gain", "heldout_gain_stderr", "heldout_n", "reward_first_version",
        "reward_last_version", "trajectories_trained", "staleness_mean", "importance_ratio_abs_dev_mean",
        "heldout_second_try_base", "heldout_second_try_base_n", "heldout_second_try_final",
        "heldout_second_try_final_stderr", "heldout_second_try_n", "heldout_second_try_penalised_base",
        "heldout_second_try_penalised_final", "kept_version", "heldout_kept", "heldout_kept_gain",
        "heldout_kept_gain_stderr", "shadow_drops", "policy_version", "duration_s", "shadow_scorer_cpu_s",
        "shadow_snapshot_s", "trainer_idle_ratio", "heldout_skill", "heldout_skill_n", "heldout_skill_base",
        "heldout_skill_final", "heldout_skill_final_gain", "heldout_skill_final_gain_stderr", "heldout_skill_kept",
        "heldout_format_ceiling")


def run_seed(seed: int, runs_dir: Path, extra: list[str], keep_weights: bool = False) -> dict:
    run_dir = runs_dir / f"seed-{seed}"
    started = time.perf_counter()
    command = [sys.executable, "-m", "sao.cli", "run", "--run-dir", str(run_dir), "--set", f"env.seed={seed}", *extra]
    completed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"seed {seed}: sao run failed ({completed.returncode}): {completed.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("heldout_gain") is None:
        raise SystemExit(f"seed {seed}: {run_dir}/summary.json has no held-out figures (is run.heldout_eval off?)")
    steps = json.loads((run_dir / "status" / "trainer.json").read_text()).get("steps") or [{}]
    if not keep_weights:  # a run's checkpoints and policy files take gigabytes; the figures are read above
        RunDir(run_dir).drop_weights()
    return {"seed": seed, "wall_s": time.perf_counter() - started, "run_dir": str(run_dir),
            "rollbacks": len(summary.get("rollbacks") or []), "kl_end": steps[-1].get("kl_k3"),
            "kl_to_base_end": steps[-1].get("kl_to_base"), "steps": [step_signals(step) for step in steps if step],
            **{key: summary.get(key) for key in KEYS}}


def step_signals(step: dict) -> dict:
    """What one optimizer step says about the run's health: the signals a collapse shows in."""
    advantages, rewards = step.get("advantages") or [], step.get("rewards") or []
    return {"step": step.get("step"), "version": step.get("policy_version"), "reward_mean": mean(rewards),
            "first_try": mean(step.get("first_attempt_success") or []), "grad_norm": step.get("grad_norm"),
            "kl_to_base": step.get("kl_to_base"), "kl_behaviour": step.get("kl_k3"), "token_nll": step.get("token_nll"),
            "advantage_sd": statistics.stdev(advantages) if len(advantages) > 1 else None,
            "advantage_positive": mean([a > 0 for a in advantages]),
            "advantage_abs_max": max((abs(a) for a in advantages), default=None),
            "staleness": mean(step.get("staleness") or [])}


def _attempt(seed: int, runs_dir: Path, extra: list[str], keep_weights: bool) -> dict:
    """`run_seed`, or {"seed", "failed"} when the run failed (the other seeds go on)."""
    try:
        return run_seed(seed, runs_dir, extra, keep_weights)
    except SystemExit as failure:
        return {"seed": seed, "failed": str(failure)[-500:]}


def over_seeds(results: list[dict]) -> dict:
    """Mean held-out gain over seeds, with its error across seeds and over tasks; the same for second tries."""
    gains = [r["heldout_gain"] for r in results]
    errors = [r["heldout_gain_stderr"] for r in results]
    second = [r["heldout_second_try_final"] for r in results]
    base_second = results[0]["heldout_second_try_base"]  # the same base model and tasks in every seed
    return {"second_try": mean(second), "second_try_stderr_seeds": stderr(second), "second_try_base": base_second,
            "second_try_above_base": sum(s is not None and base_second is not None and s > base_second for s in second),
            "gain": mean(gains), "gain_stderr_seeds": stderr(gains),
            "gain_stderr_tasks": None if None in errors else sum(e ** 2 for e in errors) ** 0.5 / len(errors),
            "base": sum(r["heldout_base"] for r in results) / len(results),
            "positive": sum(g > 0 for g in gains), "seeds": len(results),
            "worst_gain": min(gains), "below_zero": sum(g < 0 for g in gains) / len(gains),
            **_kept_over_seeds(results), **_skill_over_seeds(results)}


def _skill_over_seeds(results: list[dict]) -> dict:
    """The final versions' gain on the skill the base model lacks, where the env tags one, with the
    format-only ceiling beside it: what a model that only fixed the reply's form would score."""
    skill = [r["heldout_skill_final_gain"] for r in results if r.get("heldout_skill_final_gain") is not None]
    if not skill:
        return {}
    return {"skill": results[0]["heldout_skill"], "skill_gain": mean(skill), "skill_gain_stderr_seeds": stderr(skill),
            "skill_worst_gain": min(skill), "skill_above_base": sum(g > 0 for g in skill), "skill_runs": len(skill),
            "format_ceiling": mean([r["heldout_format_ceiling"] for r in results]),
            "above_format_ceiling": sum(r["heldout_final"] > r["heldout_format_ceiling"] for r in results)}


def _kept_over_seeds(results: list[dict]) -> dict:
    """The kept (best) versions' gains over seeds, where shadow validation ran."""
    kept = [r["heldout_kept_gain"] for r in results if r.get("heldout_kept_gain") is not None]
    if not kept:
        return {}
    return {"kept_gain": mean(kept), "kept_gain_stderr_seeds": stderr(kept), "kept_worst_gain": min(kept),
            "kept_below_zero": sum(g < 0 for g in kept) / len(kept), "kept_runs": len(kept),
            "rollbacks": sum(r["rollbacks"] for r in results)}


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)  # one seed (or one task) has no standard error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/learning"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--contended", type=int, default=1, help="Seeds run at a time (2: two runs share the cores).")
    parser.add_argument("--keep-weights", action="store_true",
                        help="Keep each run's checkpoints, policy files and optimizer snapshots (deleted once its "
                             "figures are read: gigabytes a run, and nothing the figures need).")
    parser.add_argument("extra", nargs="*", help="arguments passed on to `sao run` (after --)")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    with ThreadPoolExecutor(max_workers=args.contended) as pool:
        outcomes = list(pool.map(lambda seed: _attempt(seed, args.runs_dir, args.extra, args.keep_weights), args.seeds))
    failed = [outcome for outcome in outcomes if "failed" in outcome]
    results = [outcome for outcome in outcomes if "failed" not in outcome]
    for outcome in failed:  # a run that died is a result too: said, never dropped silently
        print(f"seed {outcome['seed']} FAILED: {outcome['failed']}", file=sys.stderr)
    if not results:
        raise SystemExit("every seed failed")
    table = Table(title="default run: greedy first-try success on held-out tasks, base model vs final version")
    for column in ("seed", "n", "base", "final", "gain ± s.e.", "skill: base -> final (n)", "second try: base -> final (n)",
                   "no new answer: base -> final", "kept v: gain ± s.e.", "drops/rollbacks", "KL end", "KL to base end",
                   "reward v first/last", "staleness", "|rho-1|", "shadow cpu / snapshot s", "train s", "wall s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["seed"]), str(r["heldout_n"]), f"{r['heldout_base']:.3f}", f"{r['heldout_final']:.3f}",
                      f"{r['heldout_gain']:+.3f} ± {_fmt(r['heldout_gain_stderr'], '.3f')}",
                      "-" if r["heldout_skill"] is None else
                      f"{r['heldout_skill']}: {r['heldout_skill_base']:.3f} -> {r['heldout_skill_final']:.3f} "
                      f"({r['heldout_skill_n']})",
                      f"{_fmt(r['heldout_second_try_base'], '.3f')} -> {_fmt(r['heldout_second_try_final'], '.3f')} ± "
                      f"{_fmt(r['heldout_second_try_final_stderr'], '.3f')} ({r['heldout_second_try_n']})",
                      f"{_fmt(r['heldout_second_try_penalised_base'], '.2f')} -> "
                      f"{_fmt(r['heldout_second_try_penalised_final'], '.2f')}",
                      "-" if r["kept_version"] is None else
                      f"v{r['kept_version']}/{r['policy_version']}: {r['heldout_kept_gain']:+.3f} ± "
                      f"{_fmt(r['heldout_kept_gain_stderr'], '.3f')}",
                      f"{r['shadow_drops'] or 0}/{r['rollbacks']}", _fmt(r["kl_end"], ".4f"),
                      _fmt(r["kl_to_base_end"], ".4f"),
                      f"{_fmt(r['reward_first_version'], '.2f')}/{_fmt(r['reward_last_version'], '.2f')}",
                      _fmt(r["staleness_mean"], ".2f"), _fmt(r["importance_ratio_abs_dev_mean"], ".3f"),
                      f"{_fmt(r['shadow_scorer_cpu_s'], '.0f')} / {_fmt(r['shadow_snapshot_s'], '.1f')}",
                      _fmt(r["duration_s"], ".0f"), f"{r['wall_s']:.0f}")
    console = Console(width=None if os.isatty(1) else 160)  # a log file gets the whole table, unwrapped
    console.print(table)
    total = over_seeds(results)
    seeds_se, tasks_se = total["gain_stderr_seeds"], total["gain_stderr_tasks"]
    console.print(f"mean held-out gain {total['gain']:+.3f} over {total['seeds']} seeds: ± {_fmt(seeds_se, '.3f')} "
                  f"across seeds ({_fmt(total['gain'] / seeds_se if seeds_se else None, '.1f')} s.e.), "
                  f"± {_fmt(tasks_se, '.3f')} over tasks; base {total['base']:.3f}; "
                  f"gain > 0 in {total['positive']} of {total['seeds']}; worst {total['worst_gain']:+.3f}, "
                  f"{total['below_zero']:.0%} of runs below zero")
    if "skill_gain" in total:
        console.print(f"skill {total['skill']}: mean gain {total['skill_gain']:+.3f} ± "
                      f"{_fmt(total['skill_gain_stderr_seeds'], '.3f')} across {total['skill_runs']} runs, above the base "
                      f"in {total['skill_above_base']}, worst {total['skill_worst_gain']:+.3f}; format-only ceiling "
                      f"{total['format_ceiling']:.3f}, final above it in {total['above_format_ceiling']} of {total['seeds']}")
    if "kept_gain" in total:
        console.print(f"kept (best) version: mean gain {total['kept_gain']:+.3f} ± "
                      f"{_fmt(total['kept_gain_stderr_seeds'], '.3f')} across {total['kept_runs']} runs; worst "
                      f"{total['kept_worst_gain']:+.3f}, {total['kept_below_zero']:.0%} below zero; "
                      f"{total['rollbacks']} rollbacks")
    console.print(f"mean held-out second-try success {_fmt(total['second_try'], '.3f')} ± "
                  f"{_fmt(total['second_try_stderr_seeds'], '.3f')} across seeds; base "
                  f"{_fmt(total['second_try_base'], '.3f')}; above it in {total['second_try_above_base']} of "
                  f"{total['seeds']}")
    if args.json:
        final = total["base"] + total["gain"]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "headline": {"metric": "greedy first-try success on held-out tasks, final version",
                         "unit": "fraction of tasks", "value": final, "baseline": total["base"],
                         # A base model that solves nothing (a tiny test model) has no ratio: null, not NaN.
                         "ratio": final / total["base"] if total["base"] else None},
            **total, "runs": results, "failed": failed}, indent=2))


if __name__ == "__main__":
    main()
