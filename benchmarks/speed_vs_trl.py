"""Seconds per optimizer step and trajectories per second: TRL's GRPOTrainer, sao sync and sao async on equal work.

    python benchmarks/speed_vs_trl.py [--steps 12] [--seeds 3] [--arms sao sao-sync trl trl-bf16]
                                      [--trl-python PATH] [--work-dir DIR] [--json PATH] [-- extra sao run args]

Every arm makes --steps optimizer steps of 8 trajectories on SmolLM2 from the same HF folder and the
same training tasks (benchmarks/vs_trl.py's setup: TRL at sao's learning rate, one prompt x 8
completions a step, fp32 or, `trl-bf16`, under bf16 autocast; sao's default run, `--num-tasks`
8 x steps, async or `run.mode = sync`, in the precision `auto` picks). Within a seed the arms run one
after the other, the order rotated from seed to seed, each from a fresh process (start-up included).

Per run: the wall time from launch to the last step's end (a sao step ends when its version's file is
written; TRL's, at `on_step_end`), the steady seconds per step (the median gap between step ends
after the first), trajectories per second over those gaps, and the process's whole wall time (sao's
includes the final version's shadow score). Beside them the work a step does, which differs: sao's
trajectories hold a second try after a wrong first answer (more generated and trained tokens),
TRL's are one completion each. Each arm's figures are also given against the best synchronous loop
measured (the fastest of the TRL arms and sao sync, by median over seeds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_trl, beside this file
from vs_trl import check_trl, run_sao, run_trl, tokens_per_trajectory, trl_setup

from sao.config import load_config
from sao.run_dir import RunDir

TRAJECTORIES_PER_STEP = 8
# The extra `sao run` arguments of each sao arm; TRL's arms: whether it runs under bf16 autocast.
SAO_ARMS = {"sao": [], "sao-sync": ["--set", "run.mode=sync"]}
TRL_ARMS = {"trl": False, "trl-bf16": True}
ARMS = (*SAO_ARMS, *TRL_ARMS)
SYNC_ARMS = ("sao-sync", *TRL_ARMS)


def step_figures(step_ends: list[float], wall_s: float, tokens_per_trajectory: float | None) -> dict:
    """A run's speed from its step ends (seconds since launch, in order) and its whole wall time."""
    gaps = [later - earlier for earlier, later in itertools.pairwise(step_ends)]
    steady = statistics.median(gaps) if gaps else None
    return {"steps": len(step_ends), "to_last_step_s": step_ends[-1] if step_ends else None, "wall_s": wall_s,
            "step_s": steady, "trajectories_per_s": TRAJECTORIES_PER_STEP / steady if steady else None,
            "tokens_per_trajectory": tokens_per_trajectory}


def sao_run(seed: int, steps: int, folder: Path, extra: list[str]) -> dict:
    checkpoints, wall_s = run_sao(seed, ["--num-tasks", str(TRAJECTORIES_PER_STEP * steps)], folder, extra)
    ends = [c["wall_s"] for c in checkpoints if c["version"] >= 1]  # version k is published by step k
    RunDir(folder).drop_weights()
    return step_figures(ends, wall_s, tokens_per_trajectory(folder))


def trl_run(python: str, config, seed: int, steps: int, folder: Path, bf16: bool) -> dict:
    setup = {**trl_setup(config, seed, 10**6, [], folder, "trl-sao-lr"), "max_steps": steps, "bf16": bf16}
    checkpoints, wall_s = run_trl(python, setup)
    ends = json.loads((folder / "steps.json").read_text())
    tokens = checkpoints[-1]["tokens"] / (TRAJECTORIES_PER_STEP * len(ends)) if ends else None
    for checkpoint in checkpoints:
        shutil.rmtree(checkpoint["path"], ignore_errors=True)
    return step_figures(ends, wall_s, tokens)


def summarise(runs: list[dict], arms: list[str]) -> dict:
    """Per arm the median over seeds of each figure, the worst seed's, and the ratio against the best sync loop."""
    keys = ("to_last_step_s", "step_s", "trajectories_per_s", "wall_s", "tokens_per_trajectory")
    per_arm = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        per_arm[arm] = {key: statistics.median(values) if (values := [r[key] for r in mine if r[key] is not None])
                        else None for key in keys}
        per_arm[arm]["worst_to_last_step_s"] = max((r["to_last_step_s"] or 0 for r in mine), default=None)
        per_arm[arm]["runs"] = len(mine)
    sync = [a for a in arms if a in SYNC_ARMS and per_arm[a]["step_s"]]
    best = min(sync, key=lambda a: per_arm[a]["step_s"]) if sync else None
    for figures in per_arm.values():
        for key in ("step_s", "to_last_step_s"):
            figures[f"{key}_vs_best_sync"] = (figures[key] / per_arm[best][key]
                                              if best and figures[key] and per_arm[best][key] else None)
    return {"best_sync": best, "arms": per_arm}


def benchmark(args: argparse.Namespace, extra: list[str]) -> dict:
    config = load_config(overrides=[v for f, v in itertools.pairwise(extra) if f == "--set"], environ={})
    trl_version = check_trl(args.trl_python) if any(a in TRL_ARMS for a in args.arms) else None
    if trl_version is None and any(a in TRL_ARMS for a in args.arms):
        raise SystemExit(f"--trl-python {args.trl_python} cannot import trl: `pip install -e \".[peers]\"` there, "
                         "or leave the trl arms out")
    work, runs = Path(args.work_dir), []
    for seed in range(args.seeds):
        shift = seed % len(args.arms)
        for arm in args.arms[shift:] + args.arms[:shift]:  # alternated, and no arm always first
            folder = work / f"{arm}-seed{seed}"
            figures = (sao_run(seed, args.steps, folder, [*extra, *SAO_ARMS[arm]]) if arm in SAO_ARMS
                       else trl_run(args.trl_python, config, seed, args.steps, folder, TRL_ARMS[arm]))
            runs.append({"arm": arm, "seed": seed, **figures})
            print(json.dumps(runs[-1]), flush=True)
    summary = summarise(runs, list(args.arms))
    first, best = args.arms[0], summary["best_sync"]
    headline = {"metric": f"seconds from launch to step {args.steps}, {first} / the best sync loop ({best})",
                "value": summary["arms"][first]["to_last_step_s"],
                "baseline": summary["arms"][best]["to_last_step_s"] if best else None,
                "ratio": summary["arms"][first]["to_last_step_s_vs_best_sync"], "unit": "s"}
    return {"headline": headline, "steps": args.steps, "seeds": args.seeds, "trl_version": trl_version,
            "model": config.policy.model, **summary, "runs": runs}


def show(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['steps']} steps of {TRAJECTORIES_PER_STEP} trajectories, {result['model']}; "
                        f"median of {result['seeds']} seed(s); best sync loop: {result['best_sync']}")
    for column in ("arm", "to last step s (worst)", "s / step", "trajectories / s", "whole run s",
                   "gen. tokens / traj.", "s / step vs best sync", "to last step vs best sync"):
        table.add_column(column, justify="right")

    def cell(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    for arm, f in result["arms"].items():
        table.add_row(arm, f"{cell(f['to_last_step_s'], '.1f')} ({cell(f['worst_to_last_step_s'], '.1f')})",
                      cell(f["step_s"], ".2f"), cell(f["trajectories_per_s"], ".2f"), cell(f["wall_s"], ".1f"),
                      cell(f["tokens_per_trajectory"], ".1f"), cell(f["step_s_vs_best_sync"], ".2f"),
                      cell(f["to_last_step_s_vs_best_sync"], ".2f"))
    Console(width=160).print(table)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps every arm makes")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1; every arm runs once a seed")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter that imports trl")
    parser.add_argument("--work-dir", default="runs/speed_vs_trl")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.steps < 2 or args.seeds < 1:
        parser.error("--steps must be >= 2 (a gap between step ends), --seeds >= 1")
    result = benchmark(args, extra)
    show(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
