"""Does the default run learn? `sao run` once per seed; reward of the first vs the last window.

    python benchmarks/learning.py [--seeds 0 1 2] [--runs-dir runs/learning] [--json PATH] [-- extra sao run args]

Each seed is a whole default run (`env.seed` changes the task stream; everything else is the
default config unless extra arguments follow `--`). From each run's summary.json it prints the
mean reward of the first and of the last `run.reward_window` (20%) of trained trajectories, the
gain with its standard error, and the wall time; then the gain averaged over seeds, whose
standard error is sqrt(sum of squared per-run errors) / seeds. The baseline of each run is its
own first window, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run_seed(seed: int, runs_dir: Path, extra: list[str]) -> dict:
    run_dir = runs_dir / f"seed-{seed}"
    started = time.perf_counter()
    command = [sys.executable, "-m", "sao.cli", "run", "--run-dir", str(run_dir), "--set", f"env.seed={seed}", *extra]
    completed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"seed {seed}: sao run failed ({completed.returncode}): {completed.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, "wall_s": time.perf_counter() - started, "run_dir": str(run_dir),
            **{key: summary[key] for key in ("reward_first_window", "reward_last_window", "reward_gain",
                                             "reward_gain_stderr", "reward_window_size", "trajectories_trained",
                                             "staleness_mean", "importance_ratio_abs_dev_mean")}}


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)  # a window of 1 has no standard error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/learning"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("extra", nargs="*", help="arguments passed on to `sao run` (after --)")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    results = [run_seed(seed, args.runs_dir, args.extra) for seed in args.seeds]
    table = Table(title="default run: reward of the first vs the last 20% of trained trajectories")
    for column in ("seed", "first", "last", "gain ± s.e.", "staleness", "|rho-1|", "wall s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["seed"]), f"{r['reward_first_window']:.3f}", f"{r['reward_last_window']:.3f}",
                      f"{r['reward_gain']:+.3f} ± {_fmt(r['reward_gain_stderr'], '.3f')}",
                      _fmt(r["staleness_mean"], ".2f"), _fmt(r["importance_ratio_abs_dev_mean"], ".3f"),
                      f"{r['wall_s']:.0f}")
    console = Console()
    console.print(table)
    gain = sum(r["reward_gain"] for r in results) / len(results)
    errors = [r["reward_gain_stderr"] for r in results]
    stderr = None if None in errors else sum(e ** 2 for e in errors) ** 0.5 / len(results)
    first = sum(r["reward_first_window"] for r in results) / len(results)
    positive = sum(r["reward_gain"] > 0 for r in results)
    console.print(f"mean gain {gain:+.3f} ± {_fmt(stderr, '.3f')} (s.e.) over {len(results)} seeds, "
                  f"{_fmt(gain / stderr if stderr else None, '.1f')} standard errors; last / first window "
                  f"{(first + gain) / first if first else float('nan'):.2f}x; gain > 0 in {positive} of {len(results)}")
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "mean reward, last 20% of trained trajectories", "unit": "reward",
                         "value": first + gain, "baseline": first, "ratio": (first + gain) / first if first else None},
            "gain": gain, "gain_stderr": stderr, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
