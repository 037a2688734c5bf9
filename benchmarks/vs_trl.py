"""sao beside TRL's GRPOTrainer on one machine: learning curves at equal wall time, one judge for both.

    python benchmarks/vs_trl.py [--minutes 4] [--seeds 1] [--points 4]
                                [--arms sao sao-reward-only trl-default trl-sao-lr]
                                [--trl-python PATH] [--heldout-cap N] [--json PATH] [--plot PATH]
                                [--work-dir DIR] [--keep-weights] [-- extra sao run args (--set k=v)]

Per seed the arms run one after the other (sao's default, sao on the reward alone, TRL at its
documented defaults, TRL at sao's learning rate), each for the same wall-clock budget counted from
its launch (start-up included): sao as `sao run --minutes N` with every version kept; TRL's
GRPOTrainer (benchmarks/_trl_peer.py, run by `--trl-python`, an interpreter with `pip install -e
".[peers]"`) saving checkpoints on a schedule. Both start from the same HF folder (the one sao
converts from the GGUF), train on sao's train split (the env's make_tasks under env.seed = seed)
with the same chat template, system prompt, temperature, top_p and max new tokens, and are rewarded
for a right first answer. sao's default also states the right answer in a wrong answer's feedback
(env.reveal_answer) and teaches it to the first try: supervision GRPO's loop has no place for.
`sao-reward-only` turns it off (env.reveal_answer=false), so that arm learns from the reward alone,
as TRL does.

Every checkpoint is judged by sao's own held-out scorer (greedy, first try, the run's chat format
and system prompt) on the same held-out tasks: at `--points` equal fractions of the budget, the last
version or checkpoint saved by then. Each point gives held-out success overall and on the skill the
base model does worst on (sao/sampler/skills.py), with n and s.e., against wall time and generated
tokens (TRL: every completion token; sao: trajectories trained by then times the run's mean tokens
per trajectory, both turns). Printed: the table at the budget, and for each sao arm against each TRL
arm: their ratio at each equal wall time, their difference paired on the same questions at the
budget, and the wall time the sao arm takes to reach the TRL arm's final score. The format-only
ceiling (share of judged tasks without the skill) is printed beside them.

Where the setups differ (they cannot match): GRPO samples a group of completions per prompt and uses
the group's mean as baseline; sao samples one trajectory per task, with a second try after feedback,
and a per-task baseline. TRL's documented defaults: lr 1e-6, 8 completions per prompt, one prompt
per step, loss "dapo", beta 0; its schedule is constant here (a wall-clock budget has no step count
for the linear default to decay over) and it runs fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sao.config import SaoConfig, load_config
from sao.processes import die_with_parent
from sao.run_dir import RunDir
from sao.stats import mean, paired_gain, stderr

# sao's arms: the extra `sao run` arguments of each.
SAO_ARMS = {"sao": [], "sao-reward-only": ["--set", "env.reveal_answer=false"]}
ARMS = (*SAO_ARMS, "trl-default", "trl-sao-lr")
TRAINING_TASKS = 4096  # more than any budget here gets through: TRL never sees the list run out
REPO = Path(__file__).resolve().parents[1]


# --- curves: pure arithmetic over judged points ----------------------------------------------------

def at_times(checkpoints: list[dict], times: list[float]) -> list[dict | None]:
    """For each time, the last checkpoint saved by then (None before the first); the last time takes the last
    checkpoint whatever its time: a step that ends after the budget still ends the run."""
    ordered = sorted(checkpoints, key=lambda c: c["wall_s"])
    picked: list[dict | None] = []
    for index, moment in enumerate(times):
        before = [c for c in ordered if c["wall_s"] <= moment]
        picked.append(ordered[-1] if index == len(times) - 1 and ordered else (before[-1] if before else None))
    return picked


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline; None where either is missing or the baseline is 0."""
    return value / baseline if value is not None and baseline else None


def time_to_reach(curve: list[dict], target: float | None, key: str = "overall") -> float | None:
    """Wall time of the first point of `curve` at or above `target` (None: never)."""
    if target is None:
        return None
    return next((point["wall_s"] for point in curve if point[key] is not None and point[key] >= target), None)


def mean_curve(runs: list[list[dict]], keys: tuple[str, ...] = ("overall", "skill", "wall_s", "tokens")) -> list[dict]:
    """Point by point over seeds: the mean of each key and its s.e. across seeds (`<key>_seeds_stderr`)."""
    curve = []
    for points in zip(*runs):
        row: dict = {"point": len(curve)}
        for key in keys:
            values = [p[key] for p in points if p.get(key) is not None]
            row[key], row[f"{key}_seeds_stderr"] = mean(values), stderr(values)
        curve.append(row)
    return curve


def figures(base: dict[str, float], scores: dict[str, float], skill_tasks: list[str]) -> dict:
    """Held-out success overall and on the skill, with s.e. and n, and the paired gains over the base."""
    tasks = list(base)
    values, on_skill = [scores[t] for t in tasks], [scores[t] for t in skill_tasks]
    gain, gain_stderr = paired_gain([base[t] for t in tasks], values)
    skill_gain, skill_gain_stderr = paired_gain([base[t] for t in skill_tasks], on_skill)
    return {"overall": mean(values), "overall_stderr": stderr(values), "n": len(values),
            "gain": gain, "gain_stderr": gain_stderr, "skill": mean(on_skill), "skill_stderr": stderr(on_skill),
            "skill_n": len(on_skill), "skill_gain": skill_gain, "skill_gain_stderr": skill_gain_stderr}


# --- the judge: sao's own held-out scorer ------------------------------------------------------------

class Judge:
    """sao's Scorer on the held-out tasks, first try only, loading sao versions or TRL checkpoints into it."""

    def __init__(self, config: SaoConfig, cap: int, work: Path):
        from sao.envs.registry import scores_first_turn_only
        from sao.sampler.evaluation import Scorer, heldout_tasks
        from sao.sampler.skills import format_ceiling, headline_skill, tag_tasks

        if scores_first_turn_only(config.env.name):  # as the shadow scorer: the first turn decides success
            config = config.model_copy(update={"env": config.env.model_copy(update={"max_turns": 1})})
        self.tasks = heldout_tasks(config, cap)
        self.scorer = Scorer(config, work, threads=len(os.sched_getaffinity(0)))
        self.base_state = {k: v.detach().clone() for k, v in self.scorer.policy.state_dict().items()}
        self.base = self._first_tries(self.scorer.score(0, self.tasks)[0])
        self.tags = tag_tasks(config.env.name, self.tasks)
        self.skill = headline_skill(self.tags, self.base)
        self.skill_tasks = [t for t in self.base if self.skill in self.tags.get(t, ())]
        self.ceiling = format_ceiling(self.tags, self.skill, list(self.base))
        self._label = 0

    @staticmethod
    def _first_tries(scores: dict) -> dict[str, float]:
        return {task: float(s["first_try"]) for task, s in scores.items()}

    def _score_loaded(self) -> dict[str, float]:
        self.scorer.roller.weights_changed()
        self._label -= 1  # a label no published version has: Scorer.load then leaves the weights as they are
        self.scorer.loaded_version = self._label
        scores, failures = self.scorer.score(self._label, self.tasks)
        if failures:  # the scorer has logged them; counted wrong, as a run's judge would see no answer
            print(f"the env failed on {len(failures)} held-out tasks (scored 0)", file=sys.stderr)
        return {t: self._first_tries(scores).get(t, 0.0) for t in self.base}

    def sao_version(self, run_dir: Path, version: int) -> dict[str, float]:
        from sao.policy.chain import read_version_into

        self.scorer.policy.load_state_dict(self.base_state)
        read_version_into(self.scorer.policy, RunDir(run_dir), version)
        return self._score_loaded()

    def trl_checkpoint(self, folder: Path) -> dict[str, float]:
        from transformers import AutoModelForCausalLM

        self.scorer.policy.load_state_dict(self.base_state)
        trained = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        self.scorer.policy.lm.load_state_dict(trained)
        return self._score_loaded()

    def point(self, scores: dict[str, float], checkpoint: dict) -> dict:
        return {**{k: checkpoint[k] for k in ("wall_s", "tokens", "label") if k in checkpoint},
                **figures(self.base, scores, self.skill_tasks)}


# --- the arms ---------------------------------------------------------------------------------------

def tokens_per_trajectory(run_dir: Path) -> float | None:
    """A sao run's mean generated tokens per trajectory produced (both turns), from its samplers' status files."""
    samplers = [json.loads(p.read_text()) for p in RunDir(run_dir).status_dir.glob("sampler-*.json")]
    produced = sum(s.get("produced", 0) for s in samplers)
    return sum(s.get("tokens", 0) for s in samplers) / produced if produced else None


def sao_checkpoints(run_dir: Path, launched: float) -> list[dict]:
    """Each kept version's wall time (its sidecar's write, from launch) and the tokens generated by then: the
    trajectories trained by then times the run's mean generated tokens per trajectory."""
    layout = RunDir(run_dir)
    steps = json.loads(layout.status("trainer").read_text()).get("steps") or []
    per_trajectory = tokens_per_trajectory(run_dir) or 0.0
    checkpoints = []
    for version in layout.kept_versions():
        published = layout.weights_sidecar(version).stat().st_mtime
        # A step's record names the version it trained from; the versions it led to are above it.
        trained = sum(len(s.get("rewards") or []) for s in steps if s.get("policy_version", 0) < version)
        checkpoints.append({"label": f"v{version}", "version": version, "wall_s": published - launched,
                            "tokens": trained * per_trajectory, "trajectories": trained})
    return checkpoints


def ends_with_this_process():
    """A preexec_fn: a killed benchmark leaves no run or TRL process behind to load the next measurement."""
    return functools.partial(die_with_parent, os.getpid())


def run_sao(seed: int, limits: list[str], run_dir: Path, extra: list[str]) -> tuple[list[dict], float]:
    """`sao run` within `limits` (its --minutes or --num-tasks), every version kept: its checkpoints and wall time."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "sao.cli", "run", "--run-dir", str(run_dir), *limits,
               "--set", "run.heldout_eval=false", "--set", "trainer.keep_versions=1000000",
               "--set", f"env.seed={seed}", "--set", f"sampler.seed={seed}", *extra]
    launched = time.time()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=ends_with_this_process())
    if completed.returncode != 0:
        raise SystemExit(f"sao run failed ({completed.returncode}): see {run_dir.parent / (run_dir.name + '.log')}")
    return sao_checkpoints(run_dir, launched), time.time() - launched


def trl_setup(config: SaoConfig, seed: int, minutes: float, save_at: list[float], out: Path, arm: str) -> dict:
    """What _trl_peer.py needs: the model folder, sao's training tasks as chat messages, sampling and the lr."""
    from sao.envs.registry import generation_settings, make_env, make_tasks

    env_config = config.env.model_copy(update={"seed": seed})
    settings, env = generation_settings(config), make_env(env_config)
    tasks = [{"messages": [{"role": "system", "content": settings.system_prompt},
                           {"role": "user", "content": env.reset(task.spec)}], "spec": task.spec}
             for task in make_tasks(env_config, TRAINING_TASKS)]
    grpo = {"temperature": settings.temperature, "top_p": settings.top_p,
            "max_completion_length": settings.max_new_tokens}
    if arm == "trl-sao-lr":
        grpo["learning_rate"] = config.trainer.learning_rate
    return {"model_dir": str(model_folder(config, out.parent)), "tasks": tasks,
            "env": env_config.model_dump(mode="json"), "seed": seed, "minutes": minutes, "save_at_s": save_at,
            "out_dir": str(out), "threads": len(os.sched_getaffinity(0)), "grpo": grpo}


def model_folder(config: SaoConfig, work: Path) -> Path:
    """The HF folder both systems start from: the one sao converts from the GGUF; for `tiny`, sao's tiny model
    (built from policy.seed) saved once with its tokenizer."""
    from sao.policy.loading import TINY, load_language_model, load_tokenizer, resolve_model_path

    if config.policy.model != TINY:
        return resolve_model_path(config.policy.model, config.policy.cache_dir)
    folder = work / "tiny-model"
    if not (folder / "config.json").is_file():
        load_language_model(TINY, config.policy.cache_dir, config.policy.seed).save_pretrained(folder)
        load_tokenizer(TINY, config.policy.cache_dir).save_pretrained(folder)
    return folder


def run_trl(python: str, setup: dict) -> tuple[list[dict], float]:
    out = Path(setup["out_dir"])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    setup_path = out / "setup.json"
    launched = time.time()
    setup_path.write_text(json.dumps({**setup, "launched_at": launched}))
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(out / "trl.log", "w") as log:
        completed = subprocess.run([python, str(REPO / "benchmarks" / "_trl_peer.py"), str(setup_path)],
                                   stdout=log, stderr=subprocess.STDOUT, env=environ,
                                   preexec_fn=ends_with_this_process())
    if completed.returncode != 0:
        raise SystemExit(f"TRL failed ({completed.returncode}): see {out / 'trl.log'}")
    checkpoints = json.loads((out / "checkpoints.json").read_text())
    return [{**c, "label": f"step {c['step']}"} for c in checkpoints], time.time() - launched


def check_trl(python: str) -> str | None:
    """The TRL version `python` imports, None when it cannot."""
    found = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


# --- the benchmark -------------------------------------------------------------------------------------

def benchmark(args: argparse.Namespace, extra: list[str]) -> dict:
    sets = [value for flag, value in itertools.pairwise(extra) if flag == "--set"]
    config = load_config(overrides=sets, environ={})
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    budget_s = args.minutes * 60
    times = [budget_s * (k + 1) / args.points for k in range(args.points)]
    trl_arms = [arm for arm in args.arms if arm not in SAO_ARMS]
    trl_version = check_trl(args.trl_python) if trl_arms else None
    if trl_arms and trl_version is None:
        raise SystemExit(f"--trl-python {args.trl_python} cannot import trl: `pip install -e \".[peers]\"` there, "
                         "or pass --arms sao")
    judge = Judge(config, args.heldout_cap, work)
    runs: list[dict] = []
    for seed in range(args.seeds):
        for arm in args.arms:  # alternated: every seed runs each arm once, in turn
            folder = work / f"{arm}-seed{seed}"
            if arm in SAO_ARMS:
                checkpoints, wall_s = run_sao(seed, ["--minutes", str(args.minutes), "--num-tasks", "1000000"],
                                              folder, [*extra, *SAO_ARMS[arm]])
            else:
                checkpoints, wall_s = run_trl(args.trl_python, trl_setup(config, seed, args.minutes, times, folder,
                                                                         arm))
            points = []
            for moment, checkpoint in zip(times, at_times(checkpoints, times)):
                if checkpoint is None:  # nothing saved yet: the base model is what this arm has
                    point = judge.point(judge.base, {"wall_s": moment, "tokens": 0, "label": "base"})
                else:
                    scores = (judge.sao_version(folder, checkpoint["version"]) if arm in SAO_ARMS
                              else judge.trl_checkpoint(Path(checkpoint["path"])))
                    point = {**judge.point(scores, checkpoint), "scores": scores}
                points.append({**point, "at_s": moment})
            runs.append({"arm": arm, "seed": seed, "wall_s": wall_s, "checkpoints": len(checkpoints),
                         "points": points})
            # What is judged so far survives a benchmark stopped before its end.
            (work / "partial.json").write_text(json.dumps(runs, indent=1, default=str))
            if not args.keep_weights:
                if arm in SAO_ARMS:
                    RunDir(folder).drop_weights()
                else:
                    for checkpoint in checkpoints:
                        shutil.rmtree(checkpoint["path"], ignore_errors=True)
    return summarise(args, config, judge, runs, trl_version)


def summarise(args: argparse.Namespace, config: SaoConfig, judge: Judge, runs: list[dict], trl_version) -> dict:
    curves = {arm: mean_curve([[{k: v for k, v in p.items() if k != "scores"} for p in r["points"]]
                               for r in runs if r["arm"] == arm]) for arm in args.arms}
    base = figures(judge.base, judge.base, judge.skill_tasks)
    comparisons = {}
    for sao_arm, arm in itertools.product([a for a in args.arms if a in SAO_ARMS],
                                          [a for a in args.arms if a not in SAO_ARMS]):
        paired = {"overall": [], "skill": []}
        for seed in range(args.seeds):
            ours, theirs = (next(r for r in runs if r["arm"] == name and r["seed"] == seed)["points"][-1]
                            for name in (sao_arm, arm))
            if "scores" in ours and "scores" in theirs:
                for key, tasks in (("overall", list(judge.base)), ("skill", judge.skill_tasks)):
                    gain, gain_stderr = paired_gain([theirs["scores"][t] for t in tasks],
                                                    [ours["scores"][t] for t in tasks])
                    paired[key].append({"seed": seed, "sao_minus_trl": gain, "stderr": gain_stderr})
        final = curves[arm][-1]
        comparisons[f"{sao_arm} vs {arm}"] = {
            "sao_arm": sao_arm, "trl_arm": arm,
            "ratio_overall": [ratio(s["overall"], t["overall"]) for s, t in zip(curves[sao_arm], curves[arm])],
            "ratio_skill": [ratio(s["skill"], t["skill"]) for s, t in zip(curves[sao_arm], curves[arm])],
            "paired_at_budget": paired,
            "sao_time_to_trl_final_s": time_to_reach(curves[sao_arm], final["overall"]),
            "sao_time_to_trl_final_skill_s": time_to_reach(curves[sao_arm], final["skill"], "skill"),
            "trl_final_wall_s": final["wall_s"]}
    for run in runs:
        for point in run["points"]:
            point.pop("scores", None)
    headline_arm = ("trl-sao-lr" if "trl-sao-lr" in args.arms
                    else next((a for a in args.arms if a not in SAO_ARMS), None))
    sao_final = curves["sao"][-1]["overall"] if "sao" in curves else None
    trl_final = curves[headline_arm][-1]["overall"] if headline_arm else None
    return {
        "headline": {"metric": f"held-out first-try success at equal wall time ({args.minutes:g} min), sao / "
                               f"{headline_arm or 'TRL'}", "value": sao_final, "baseline": trl_final,
                     "ratio": ratio(sao_final, trl_final), "unit": "fraction of held-out tasks"},
        "minutes": args.minutes, "seeds": args.seeds, "points_s": [p["at_s"] for p in runs[0]["points"]] if runs else [],
        "arms": list(args.arms), "trl_version": trl_version, "model": config.policy.model,
        "learning_rate_sao": config.trainer.learning_rate, "heldout_n": len(judge.base), "skill": judge.skill,
        "skill_n": len(judge.skill_tasks), "format_ceiling": judge.ceiling, "base": base,
        "curves": curves, "comparisons": comparisons, "runs": runs,
        "setup_differences": ["GRPO samples a group of completions per prompt (group-mean baseline); sao one "
                              "trajectory per task (per-task baseline) with a second try after feedback",
                              "TRL's schedule is constant (no step count in a wall-clock budget); fp32 on CPU",
                              "sao's generated tokens are estimated: trajectories trained x mean tokens per "
                              "trajectory (both turns); TRL's are counted"]}


def show(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    skill = result["skill"]
    table = Table(title=f"held-out success, {result['minutes']:g} min a run, n={result['heldout_n']} "
                        f"(skill {skill}: n={result['skill_n']}; format-only ceiling {result['format_ceiling']:.3f})")
    for column in ("arm", "seed", "at", "checkpoint", "tokens", "overall", "gain", f"{skill}", f"{skill} gain"):
        table.add_column(column, justify="right")
    base = result["base"]
    table.add_row("base", "-", "-", "-", "0", f"{base['overall']:.3f} ± {base['overall_stderr'] or 0:.3f}", "-",
                  f"{base['skill']:.3f}", "-")
    for run in result["runs"]:
        for point in run["points"]:
            table.add_row(run["arm"], str(run["seed"]), f"{point['wall_s']:.0f} s", point.get("label", "-"),
                          f"{point['tokens']:.0f}", f"{point['overall']:.3f} ± {point['overall_stderr'] or 0:.3f}",
                          f"{point['gain']:+.3f} ± {point['gain_stderr'] or 0:.3f}",
                          f"{point['skill']:.3f} ± {point['skill_stderr'] or 0:.3f}",
                          f"{point['skill_gain']:+.3f} ± {point['skill_gain_stderr'] or 0:.3f}")
    console.print(table)
    for comparison in result["comparisons"].values():
        ours, arm = comparison["sao_arm"], comparison["trl_arm"]
        ratios = ", ".join("-" if r is None else f"{r:.2f}" for r in comparison["ratio_overall"])
        skill_ratios = ", ".join("-" if r is None else f"{r:.2f}" for r in comparison["ratio_skill"])
        console.print(f"{ours} / {arm} at equal wall time {result['points_s']}: overall {ratios}; "
                      f"{skill} {skill_ratios}")
        for key in ("overall", "skill"):
            for row in comparison["paired_at_budget"][key]:
                console.print(f"  seed {row['seed']} {ours} - {arm} at the budget, {key}: "
                              f"{row['sao_minus_trl']:+.3f} ± {row['stderr'] or 0:.3f} (paired on the same questions)")
        reach = comparison["sao_time_to_trl_final_s"]
        console.print(f"  {ours} reaches {arm}'s final overall score at "
                      + ("never within the budget" if reach is None
                         else f"{reach:.0f} s = {reach / comparison['trl_final_wall_s']:.2f} of its wall time"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8), sharey="row")
    for run in result["runs"]:
        for row, key in enumerate(("overall", "skill")):
            for column, x in enumerate(("wall_s", "tokens")):
                # Every curve starts from the base model at 0 s and 0 tokens.
                axes[row][column].plot([0] + [p[x] for p in run["points"]],
                                       [result["base"][key]] + [p[key] for p in run["points"]], marker="o",
                                       label=f"{run['arm']} seed {run['seed']}")
    for column, x in enumerate(("wall time (s)", "generated tokens")):
        axes[0][column].axhline(result["base"]["overall"], color="grey", linestyle=":", label="base")
        axes[0][column].axhline(result["format_ceiling"], color="black", linestyle="--", label="format-only ceiling")
        axes[1][column].set_xlabel(x)
    axes[0][0].set_ylabel(f"held-out first-try success (n={result['heldout_n']})")
    axes[1][0].set_ylabel(f"on skill {result['skill']} (n={result['skill_n']})")
    axes[0][1].legend(fontsize=7)
    figure.suptitle(f"sao vs TRL GRPOTrainer, {result['minutes']:g} min a run, {result['model']}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of every run")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1; every arm runs once a seed")
    parser.add_argument("--points", type=int, default=4, help="points of each learning curve (equal time steps)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter that imports trl")
    parser.add_argument("--heldout-cap", type=int, default=80, help="held-out tasks judged (run.heldout_cap's)")
    parser.add_argument("--work-dir", default="runs/vs_trl")
    parser.add_argument("--keep-weights", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG of the curves (default: next to --json, else in --work-dir)")
    args = parser.parse_args(own)
    if args.minutes <= 0 or args.seeds < 1 or args.points < 1:
        parser.error("--minutes must be > 0, --seeds and --points >= 1")
    result = benchmark(args, extra)
    show(result)
    path = args.plot or (args.json.with_suffix(".png") if args.json else Path(args.work_dir) / "vs_trl.png")
    plot(result, path)
    result["plot"] = str(path)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
