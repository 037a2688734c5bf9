"""How much sampling noise does replay remove from a trainer comparison?

    python benchmarks/replay_noise.py [--runs-dir runs/replay-noise] [--every 2] [--tasks 80] [--json PATH]
                                      [--set trainer.learning_rate=3e-5] [-- extra sao run args]

Two default runs with the same config and seed (`original` and `independent`; async runs differ by
what their samplers happened to draw and when), then the original's trajectory log replayed twice:
unchanged (`sao replay`, which must rebuild every version's hash; timed against the original
trainer's busy time) and with `--set` (`sao replay --set ... --out`: the same trajectories, another
setting). Every `--every`-th version of the three is scored by sao's held-out scorer (greedy,
first try, the same questions). Printed per version: each score, and paired over questions the
independent run against the original (the noise a comparison of two runs carries) and the changed
setting against the original (what replay measures with that noise removed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sao.config import load_config
from sao.run_dir import RunDir
from sao.sampler.evaluation import Scorer, heldout_tasks
from sao.stats import mean, paired_gain


def sao(*args: str) -> float:
    """Run `sao ARGS`; its wall time. A failure ends the benchmark with its message."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sao.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"sao {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - started


def trainer_busy_s(run_dir: Path) -> float:
    """Seconds the run's trainer spent in its optimizer steps (forward, backward, optimizer)."""
    steps = json.loads((run_dir / "status" / "trainer.json").read_text())["steps"]
    return sum(step["step_s"] for step in steps)


def scores(run_dir: Path, config_path: Path, versions: list[int], count: int) -> dict[int, list[float]]:
    """First-try success of each version on the same held-out questions (v0, the base, first)."""
    config = load_config(config_path, [], environ={})
    tasks = heldout_tasks(config, count)
    scorer = Scorer(config, run_dir, threads=len(os.sched_getaffinity(0)))
    result = {}
    for version in versions:
        per_task, failures = scorer.score(version, tasks)
        if failures:
            raise SystemExit(f"{run_dir} v{version}: the env failed on {len(failures)} held-out tasks")
        result[version] = [per_task[task.task_id]["first_try"] for task in tasks]
    return result


def paired(base: list[float], other: list[float]) -> dict:
    gain, error = paired_gain(base, other)
    return {"gain": gain, "stderr": error, "differ": sum(a != b for a, b in zip(base, other))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/replay-noise"))
    parser.add_argument("--every", type=int, default=2, help="Score every N-th version (and the last).")
    parser.add_argument("--tasks", type=int, default=80, help="Held-out questions each version is scored on.")
    parser.add_argument("--set", dest="knob", default="trainer.learning_rate=3e-5",
                        help="The trainer setting the replay changes.")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep-weights", action="store_true",
                        help="Keep the three runs' version files and checkpoints (gigabytes; deleted once scored).")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    original, independent, changed = (args.runs_dir / name for name in ("original", "independent", "changed"))
    run_args = ["--set", "run.heldout_eval=false", "--set", "trainer.keep_versions=100000", *extra]
    walls = {name: sao("run", "--run-dir", str(path), *run_args) for name, path in
             (("original", original), ("independent", independent))}
    replay_s = sao("replay", str(original))  # exits non-zero unless every version's hash matches
    sao("replay", str(original), "--set", args.knob, "--out", str(changed))
    final = json.loads((original / "summary.json").read_text())["policy_version"]
    versions = sorted({0, *range(args.every, final + 1, args.every), final})
    config = RunDir(original).config
    by_run = {name: scores(path, config, versions, args.tasks) for name, path in
              (("original", original), ("independent", independent), ("changed", changed))}
    if not args.keep_weights:  # every version of three runs is kept for scoring: gigabytes
        for path in (original, independent, changed):
            RunDir(path).drop_weights()
    rows = []
    for version in versions:
        base = by_run["original"][version]
        rows.append({"version": version, **{name: mean(s[version]) for name, s in by_run.items()},
                     "independent_vs_original": paired(base, by_run["independent"][version]),
                     "changed_vs_original": paired(base, by_run["changed"][version])})
    result = {"knob": args.knob, "tasks": args.tasks, "versions": rows, "run_wall_s": walls,
              "replay_s": replay_s, "original_trainer_busy_s": trainer_busy_s(original)}
    print(f"replay of the original: every version's hash matched, {replay_s:.1f} s against its trainer's "
          f"{result['original_trainer_busy_s']:.1f} s of steps; runs {walls['original']:.0f} s and "
          f"{walls['independent']:.0f} s")
    print(f"first-try success on {args.tasks} held-out questions; paired differences against the original")
    print("| version | original | independent | changed | independent - original | changed - original |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        cells = [f"{row[name]:.3f}" for name in ("original", "independent", "changed")]
        for key in ("independent_vs_original", "changed_vs_original"):
            p = row[key]
            cells.append(f"{p['gain']:+.3f} ± {p['stderr']:.3f} ({p['differ']} differ)")
        print(f"| v{row['version']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
