"""End-of-run report: `report.md` and PNG plots in the run directory, from what the run recorded.

Reads only files: `summary.json`, `config.toml`, the progress files in `status/` (the trainer's
holds its `StepRecord`s) and `eval/heldout.json` (the held-out comparison that ends `sao run`).
`build_summary` makes `summary.json` from the same files. So it works on any run directory, also
after the fact: `python -m sao.report RUN_DIR`. Series a run did not record
are left out of the text, and their plot says so, rather than failing the report.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import tomllib
from rich.table import Column, Table

from sao.config import SaoConfig
from sao.run_dir import RunDir
from sao.stats import finite, mean, percentile, stderr
from sao.status import StepRecord, TrainerProgress, per_trajectory, read_all_status, read_status, trainer_steps

PLOTS = ("reward", "throughput", "staleness", "compression_ratio", "training")


def write_report(run_dir: Path, summary: dict[str, Any] | None = None) -> Path:
    """Write `run_dir/report.md` and `run_dir/plots/*.png`; return the report's path."""
    layout = RunDir(run_dir)
    if summary is None:
        summary = json.loads(layout.summary.read_text())
    trainer = read_status(layout.status("trainer"))
    samplers = read_all_status(layout.status_dir, "sampler-")
    steps = trainer_steps(trainer)
    try:  # the staleness budget, for its plot and text; none where config.toml is missing or unreadable
        max_staleness = tomllib.loads(layout.config.read_text()).get("trainer", {}).get("max_staleness")
    except (FileNotFoundError, tomllib.TOMLDecodeError):
        max_staleness = None
    layout.plots.mkdir(parents=True, exist_ok=True)
    _plot_all(steps, max_staleness, layout.plots, summary)
    layout.report.write_text(_markdown(layout.root, summary, trainer, samplers, steps, max_staleness))
    return layout.report


# --- series ------------------------------------------------------------------------------------

def _rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` finite values at each point (NaN where there are none)."""
    means = [mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
    return [float("nan") if m is None else m for m in means]


def _window(count: int) -> int:
    return max(1, count // 10)


def _throughput(steps: list[StepRecord]) -> tuple[list[float], list[float], list[float]]:
    """(seconds since the first step, cumulative trajectories, trajectories/s since the previous step).

    The first step has no previous one, so its rate is NaN (not plotted).
    """
    if not steps:
        return [], [], []
    trained_at = [record.trained_at for record in steps]
    cumulative = list(itertools.accumulate(record.batch_size for record in steps))
    elapsed = [t - trained_at[0] for t in trained_at]
    rates = [float("nan")] + [(done - done_before) / (at - before) if at > before else float("nan")
                              for (before, done_before), (at, done) in itertools.pairwise(zip(trained_at, cumulative))]
    return elapsed, cumulative, rates


# --- summary ---------------------------------------------------------------------------------

HELDOUT_KEYS = ("heldout_base", "heldout_final", "heldout_gain", "heldout_gain_stderr", "heldout_n")
# The version shadow validation kept as best, scored on the same held-out tasks (sao/trainer/shadow.py).
KEPT_KEYS = ("kept_version", "heldout_kept", "heldout_kept_gain", "heldout_kept_gain_stderr")
# Held-out second-try success: right at the second attempt, among the tasks whose first attempt
# failed; each version has its own n (its own first-try failures), so the two are not paired.
SECOND_TRY_KEYS = ("heldout_second_try_base", "heldout_second_try_base_stderr", "heldout_second_try_base_n",
                   "heldout_second_try_final", "heldout_second_try_final_stderr", "heldout_second_try_n",
                   "heldout_second_try_penalised_base", "heldout_second_try_penalised_final")
# Held-out success on the skill the base model does worst on (sao/sampler/skills.py), paired like the whole, and
# the format-only ceiling: the share of judged tasks without that skill.
SKILL_KEYS = ("heldout_skill", "heldout_skill_n", "heldout_skill_base", "heldout_skill_base_stderr",
              "heldout_skill_final", "heldout_skill_final_stderr", "heldout_skill_final_gain",
              "heldout_skill_final_gain_stderr", "heldout_skill_kept", "heldout_skill_kept_stderr",
              "heldout_skill_kept_gain", "heldout_skill_kept_gain_stderr", "heldout_format_ceiling", "heldout_skills")


def reward_by_version(steps: list[StepRecord]) -> list[dict[str, Any]]:
    """Mean sampled reward of the trained trajectories of each behaviour version, with n and s.e.

    Grouped by the version that sampled them, never by completion order: within a batch, quick
    episodes (right at the first try) finish first, so windows of trained trajectories that do not
    line up with versions mix policies and bias the comparison.
    """
    groups: dict[int, list[float]] = {}
    for version, reward in zip(per_trajectory(steps, "behaviour_versions"), per_trajectory(steps, "rewards")):
        if isinstance(reward, (int, float)) and math.isfinite(reward):
            groups.setdefault(int(version), []).append(float(reward))
    return [{"version": version, "n": len(rewards), "mean": sum(rewards) / len(rewards), "stderr": stderr(rewards)}
            for version, rewards in sorted(groups.items())]


def attempts_by_version(steps: list[StepRecord]) -> list[dict[str, Any]]:
    """First-attempt success, and second-attempt success among the trajectories whose first attempt
    failed, of the trained trajectories of each behaviour version, each with n and s.e.

    Grouped like `reward_by_version`. Steps recorded before the trainer kept attempts are left out.
    """
    groups: dict[int, tuple[list[float], list[float]]] = {}
    for record in steps:
        if len(record.first_attempt_success) != record.batch_size:
            continue
        for version, first, second in zip(record.behaviour_versions, record.first_attempt_success,
                                          record.second_attempt_success):
            firsts, seconds = groups.setdefault(int(version), ([], []))
            firsts.append(float(first))
            if second is not None:
                seconds.append(float(second))
    return [{"version": version, "first_n": len(firsts), "first_success": mean(firsts), "first_stderr": stderr(firsts),
             "second_n": len(seconds), "second_success": mean(seconds), "second_stderr": stderr(seconds)}
            for version, (firsts, seconds) in sorted(groups.items())]


def shadow_figures(trainer: dict[str, Any]) -> dict[str, Any]:
    """Shadow validation's board as the trainer left it: scores by version, the best, drops, rollbacks."""
    board = trainer.get("shadow") or {}
    return {"shadow_scores": board.get("scores"), "shadow_best": board.get("best"),
            "shadow_drops": len(board.get("drops") or []), "rollbacks": board.get("rollbacks") or [],
            "shadow_scorer_cpu_s": board.get("scorer_cpu_s"), "shadow_scorer_peak_rss_mb": board.get("scorer_peak_rss_mb"),
            "shadow_snapshot_s": board.get("snapshot_s")}


def _ratio(part: Any, whole: Any) -> float | None:
    return part / whole if isinstance(part, (int, float)) and isinstance(whole, (int, float)) and whole > 0 else None


def cpu_accounting(layout: RunDir, trainer: dict[str, Any], samplers: dict[str, dict], duration_s: float
                   ) -> dict[str, Any]:
    """Where the cores went: CPU seconds of each role / the run's wall seconds, and the idle ratios.

    Each process wrote its own CPU seconds (user + system, all threads) in its progress file;
    the launcher wrote its own and the embedded broker's (None with an external broker).
    Utilisation is their total over the cores the launcher may run on.
    """
    launcher = read_status(layout.status("launcher"))
    sampler_cpu = [s["cpu_s"] for s in samplers.values() if "cpu_s" in s]
    seconds = {"trainer": trainer.get("cpu_s"), "samplers": sum(sampler_cpu) if sampler_cpu else None,
               "broker": launcher.get("broker_cpu_s"), "launcher": launcher.get("cpu_s")}
    busy: dict[str, float | None] = {role: _ratio(cpu_s, duration_s) for role, cpu_s in seconds.items()}
    known = [value for value in busy.values() if value is not None]
    busy["total"] = sum(known) if known else None
    cores = launcher.get("cores")
    return {"cpu_cores_busy": busy, "cpu_utilisation": _ratio(busy["total"], cores), "cores": cores,
            "trainer_idle_ratio": _ratio(trainer.get("idle_s"), trainer.get("run_s")),
            "sampler_idle_ratio": mean([_ratio(s.get("idle_s"), s.get("run_s")) for s in samplers.values()])}


def tasks_fed(config: SaoConfig, layout: RunDir) -> int:
    """Tasks the feeder sent, from its progress file (a run stopped by run.max_minutes sends fewer than
    run.num_tasks; grpo sends each task group_size times); run.num_tasks where the file is missing."""
    fed = read_status(layout.status("feeder")).get("fed")
    return fed // config.trainer.algorithm.copies_per_task if isinstance(fed, int) else config.run.num_tasks


def build_summary(config: SaoConfig, run_dir: Path, duration_s: float) -> dict:
    """The run's figures, from the progress files: what `sao run` prints and writes to summary.json.

    It leads with what the run learned, measured on held-out tasks never trained on: greedy
    first-try success of the base model and of the final version, and their paired difference.
    """
    layout = RunDir(run_dir)
    samplers = read_all_status(layout.status_dir, "sampler-")
    trainer = read_status(layout.status("trainer"))
    progress = TrainerProgress.from_status(trainer)
    steps = trainer_steps(trainer)
    rewards = per_trajectory(steps, "rewards")
    versions = per_trajectory(steps, "behaviour_versions")
    by_version = reward_by_version(steps)
    heldout = read_status(layout.heldout)
    return {
        # The paired held-out comparison that ends `sao run` (None each when it did not run).
        **{key: heldout.get(key) for key in HELDOUT_KEYS + SECOND_TRY_KEYS + KEPT_KEYS + SKILL_KEYS},
        **shadow_figures(trainer),
        "reward_first_version": by_version[0]["mean"] if by_version else None,
        "reward_last_version": by_version[-1]["mean"] if by_version else None,
        "reward_by_version": by_version,
        "attempts_by_version": attempts_by_version(steps),
        "trajectories_produced": sum(s.get("produced", 0) for s in samplers.values()),
        "trajectories_trained": len(rewards),
        "duplicates_dropped": progress.duplicates,
        "tasks_fed": tasks_fed(config, layout),
        "algorithm": config.trainer.algorithm.label(),
        "trainer_steps": progress.step,
        "policy_version": progress.policy_version,
        "max_behaviour_version": max(versions, default=0),
        "trajectories_from_reloaded_policy": sum(1 for v in versions if v > 0),
        "sampler_reloads": sum(s.get("reloads", 0) for s in samplers.values()),
        "compression_ratio": mean(per_trajectory(steps, "compression_ratios")),
        "importance_ratio_mean": mean([r.ratio_mean for r in steps]),
        "importance_ratio_abs_dev_mean": mean([r.ratio_abs_dev for r in steps]),
        "grad_norm_mean": mean([r.grad_norm for r in steps]),
        "staleness_mean": mean(per_trajectory(steps, "staleness")),
        "dead_lettered": progress.dead_lettered + sum(s.get("dead_lettered", 0) for s in samplers.values()),
        # Task messages samplers dead-lettered, each once (the sum above counts a redelivered one per sampler)
        # and none whose trajectory was trained after all: the trainer reads them back from the DLQ.
        "tasks_dead_lettered": progress.tasks_dead_lettered,
        "trainer_wait_s": trainer.get("wait_s"),
        "trainer_peak_rss_mb": trainer.get("peak_rss_mb"),
        "sampler_peak_rss_mb": max((s["peak_rss_mb"] for s in samplers.values() if "peak_rss_mb" in s), default=None),
        "trainer_step_s_mean": mean([r.step_s for r in steps]),
        "duration_s": duration_s,
        "trajectories_per_s": _ratio(len(rewards), duration_s),
        **cpu_accounting(layout, trainer, samplers, duration_s),
        # Per trajectory, from its creation in a sampler to the step that trained it: seconds, and
        # policy versions (the trained step's version minus the behaviour version, i.e. its staleness).
        "sampling_to_training_s_p50": percentile(per_trajectory(steps, "sampling_to_training_s"), 50),
        "sampling_to_training_s_p95": percentile(per_trajectory(steps, "sampling_to_training_s"), 95),
        "sampling_to_training_steps_p50": percentile(per_trajectory(steps, "staleness"), 50),
        "sampling_to_training_steps_p95": percentile(per_trajectory(steps, "staleness"), 95),
        "model": config.policy.model,
    }


def summary_table(summary: dict, run_dir: Path) -> Table:
    """What `sao run` prints at its end: the figures a user decides on, one screen at most (docs/summary.md
    says what every key of summary.json means; report.md has them all)."""
    table = Table("figure", Column("value", justify="right"),
                  title="sao run summary (every figure: summary.json, report.md; their meaning: docs/summary.md)")
    for name, value in [*decision_rows(summary), ("run directory", str(run_dir))]:
        table.add_row(name, value)
    return table


def decision_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) rows: held-out success base -> final -> kept with their gains, the skill, the cost."""
    get = summary.get

    def show(key: str, spec: str | None = None) -> str:
        return _fmt(get(key), spec)

    rows: list[tuple[str, str]] = []
    if get("heldout_n"):
        rows.append((f"held-out first-try success, base v0 -> final v{show('policy_version')}",
                     f"{show('heldout_base')} -> {show('heldout_final')} (gain {show('heldout_gain', '+.4g')} ± "
                     f"{show('heldout_gain_stderr')}, n={show('heldout_n')})"))
        if get("heldout_kept") is not None and get("kept_version") not in (None, get("policy_version")):
            rows.append((f"kept by shadow validation: v{show('kept_version')}",
                         f"{show('heldout_kept')} (gain {show('heldout_kept_gain', '+.4g')} ± "
                         f"{show('heldout_kept_gain_stderr')}; RUN_DIR/policy/best)"))
        if get("heldout_skill"):
            rows.append((f"skill {show('heldout_skill')}, base -> final",
                         f"{show('heldout_skill_base')} -> {show('heldout_skill_final')} (gain "
                         f"{show('heldout_skill_final_gain', '+.4g')} ± {show('heldout_skill_final_gain_stderr')}, "
                         f"n={show('heldout_skill_n')})"
                         + (f"; kept {show('heldout_skill_kept')}" if get("heldout_skill_kept") is not None else "")))
            rows.append(("format-only ceiling", show("heldout_format_ceiling")))
        if get("heldout_second_try_n") or get("heldout_second_try_base_n"):
            rows.append(("second-try success after a wrong first, base -> final",
                         f"{show('heldout_second_try_base')} (n={show('heldout_second_try_base_n')}) -> "
                         f"{show('heldout_second_try_final')} (n={show('heldout_second_try_n')})"))
        if get("heldout_second_try_penalised_base") or get("heldout_second_try_penalised_final"):
            # arithmetic's env.repeat_penalty: a rejected answer again, or none
            rows.append(("second tries with no new answer (penalised), base -> final",
                         f"{show('heldout_second_try_penalised_base')} -> {show('heldout_second_try_penalised_final')}"))
    else:
        rows.append(("held-out evaluation", "none (run.heldout_eval = false, nothing published, or it failed)"))
    return rows + [
        ("sampled reward, first -> last version", f"{show('reward_first_version')} -> {show('reward_last_version')}"),
        ("trajectories trained / produced",
         f"{show('trajectories_trained')} / {show('trajectories_produced')} ({show('dead_lettered')} dead-lettered)"),
        ("optimizer steps, last version", f"{show('trainer_steps')}, v{show('policy_version')}"),
        ("wall time of training", f"{show('duration_s')} s"),
        ("throughput", f"{show('trajectories_per_s')} trajectories/s"),
        ("CPU busy", f"{show('cpu_utilisation', '.0%')} of {show('cores')} cores"),
        ("mean staleness", f"{show('staleness_mean')} versions"),
        ("peak memory, trainer / sampler", f"{show('trainer_peak_rss_mb')} / {show('sampler_peak_rss_mb')} MiB"),
    ]


# --- plots -------------------------------------------------------------------------------------

def _plot_all(steps: list[StepRecord], max_staleness: Any, plots_dir: Path, summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    def plot_series(name: str, key: str, ylabel: str, title: str, budget: float | None = None) -> None:
        fig, ax = plt.subplots(figsize=(8, 4))
        values = finite(per_trajectory(steps, key))
        if values:
            x = list(range(1, len(values) + 1))
            ax.plot(x, values, ".", alpha=0.35, label="per trajectory")
            ax.plot(x, _rolling_mean(values, _window(len(values))), "-", label=f"rolling mean ({_window(len(values))})")
            if budget is not None:
                ax.axhline(budget, color="red", linestyle="--", label="trainer.max_staleness")
            ax.set_xlabel("trajectories trained")
            ax.legend(loc="best")
        else:
            _no_data(ax, key)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        _save(fig, plots_dir / f"{name}.png", plt)

    _plot_reward(steps, summary, plots_dir, plt)
    plot_series("staleness", "staleness", "policy versions behind", "Staleness at training time",
                float(max_staleness) if isinstance(max_staleness, (int, float)) else None)
    plot_series("compression_ratio", "compression_ratios", "naive / compressed context bytes",
                "Context compression ratio")

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    elapsed, cumulative, rates = _throughput(steps)
    if elapsed:
        top.plot(elapsed, cumulative, "-o", markersize=3)
        top.set_ylabel("trajectories trained")
        bottom.plot(elapsed, rates, "-o", markersize=3, label="per step")
        bottom.plot(elapsed, _rolling_mean(rates, _window(len(rates))), "-", label="rolling mean")
        bottom.set_ylabel("trajectories / s")
        bottom.set_xlabel("seconds since the first step")
        bottom.legend(loc="best")
    else:
        _no_data(top, "trained_at")
        _no_data(bottom, "step_s")
    top.set_title("Trainer throughput")
    _save(fig, plots_dir / "throughput.png", plt)

    series = [("loss", "loss"), ("grad_norm", "grad norm (before clipping)"), ("ratio_abs_dev", "mean |rho - 1|")]
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 7), sharex=True)
    for ax, (key, label) in zip(axes, series):
        values = [getattr(record, key) for record in steps]
        if finite(values):
            ax.plot(range(1, len(values) + 1), [v if isinstance(v, (int, float)) else float("nan") for v in values],
                    "-o", markersize=3)
        else:
            _no_data(ax, key)
        ax.set_ylabel(label)
    axes[0].set_title("Training health per step")
    axes[-1].set_xlabel("optimizer step")
    _save(fig, plots_dir / "training.png", plt)


def _plot_reward(steps: list[StepRecord], summary: dict[str, Any], plots_dir: Path, plt) -> None:
    """Sampled reward per behaviour version (mean ± s.e.), and the held-out first-try success."""
    fig, ax = plt.subplots(figsize=(8, 4))
    groups = reward_by_version(steps)
    if groups:
        versions = [group["version"] for group in groups]
        rewards = [(v, r) for v, r in zip(per_trajectory(steps, "behaviour_versions"), per_trajectory(steps, "rewards"))
                   if isinstance(r, (int, float)) and math.isfinite(r)]
        # Spread equal points sideways a little so that the many identical rewards stay visible.
        ax.plot([v + 0.3 * ((i * 0.618) % 1 - 0.5) for i, (v, _) in enumerate(rewards)], [r for _, r in rewards],
                ".", alpha=0.25, label="sampled reward, per trajectory")
        ax.errorbar(versions, [group["mean"] for group in groups], yerr=[group["stderr"] or 0 for group in groups],
                    fmt="-o", capsize=3, label="mean ± s.e. per behaviour version")
        base, final = summary.get("heldout_base"), summary.get("heldout_final")
        if base is not None and final is not None:
            ax.plot([0, summary.get("policy_version") or max(versions)], [base, final], "s--", color="black",
                    label=f"held-out first-try success, greedy (n={summary.get('heldout_n')})")
        scored = summary.get("shadow_scores") or {}
        if scored:
            shown = sorted((int(v), figures["success"]) for v, figures in scored.items())
            ax.plot([v for v, _ in shown], [success for _, success in shown], "^:", color="tab:green",
                    label=f"shadow validation, greedy first try (n={next(iter(scored.values()))['n']})")
        ax.set_xlabel("behaviour version (policy that sampled the trajectory)")
        ax.legend(loc="best", fontsize="small")
    else:
        _no_data(ax, "rewards")
    ax.set_ylabel("total reward")
    ax.set_title("Reward by policy version")
    _save(fig, plots_dir / "reward.png", plt)


def _no_data(ax, key: str) -> None:
    ax.text(0.5, 0.5, f"no '{key}' recorded in this run", ha="center", va="center", transform=ax.transAxes)


def _save(fig, path: Path, plt) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- text --------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str | None = None) -> str:
    """A figure as text: a float to 4 significant digits, or any finite number by `spec` (signed, percent...)."""
    if value is None:
        return "-"
    if isinstance(value, list):
        return f"{len(value)} entries, below"
    if isinstance(value, dict):
        return ", ".join(f"{key} {_fmt(item)}" for key, item in value.items())
    if isinstance(value, (int, float)) and math.isfinite(value) and (spec or isinstance(value, float)):
        return format(value, spec or ".4g")
    return str(value)


def _heldout_sentence(summary: dict[str, Any]) -> str:
    base, final, gain, stderr, n = (summary.get(key) for key in HELDOUT_KEYS)
    if gain is None:
        return ("No held-out evaluation in this run (`run.heldout_eval = false`, no version published, or it "
                "failed): the sampled rewards below are all there is.")
    text = (f"On {n} held-out tasks never trained on, greedy first-try success went from {_fmt(base)} (base model) "
            f"to {_fmt(final)} (final version): a paired gain of {_fmt(gain)} ± {_fmt(stderr)} (s.e. over tasks)")
    if not stderr:  # the same answer to every task from both
        return text + "." + _kept_sentence(summary)
    ratio = gain / stderr
    verdict = ("beyond two, so unlikely to come from the choice of tasks alone" if abs(ratio) > 2
               else "within two, so not distinguishable from no change on these tasks")
    return (f"{text}: {ratio:+.1f} standard errors, {verdict}. The error covers the tasks, not the run's own "
            "randomness: compare seeds (benchmarks/learning.py) before trusting a small gain." + _kept_sentence(summary))


def _skill_lines(summary: dict[str, Any]) -> list[str]:
    """Held-out success by skill: a sentence on the headline skill and the format-only ceiling, then a table."""
    skill, skills = summary.get("heldout_skill"), summary.get("heldout_skills")
    if not skill or not isinstance(skills, dict):
        return []
    kept = any(row.get("kept") is not None for row in skills.values())
    text = (f"The skill the base model does worst on is `{skill}` (n={summary.get('heldout_skill_n')}): "
            f"{_fmt(summary.get('heldout_skill_base'))} for the base model, "
            f"{_fmt(summary.get('heldout_skill_final'))} for the final version (a paired gain of "
            f"{_fmt(summary.get('heldout_skill_final_gain'))} ± {_fmt(summary.get('heldout_skill_final_gain_stderr'))})"
            + (f", {_fmt(summary.get('heldout_skill_kept'))} for the kept one" if kept else "")
            + f". Format-only ceiling {_fmt(summary.get('heldout_format_ceiling'))}: the success of a model that "
            f"gets every task without `{skill}` right and every one with it wrong, the most that fixing the "
            "reply's form can reach while the skill is not learned.")
    versions = ["base", "final", *(["kept"] if kept else [])]

    def cells(row: dict[str, Any]) -> list[str]:
        return [f"{_fmt(row.get(v))} ± {_fmt(row.get(f'{v}_stderr'))}" for v in versions] + [
            f"{_fmt(row.get(f'{v}_gain'))} ± {_fmt(row.get(f'{v}_gain_stderr'))}" for v in versions[1:]]

    header = ["skill", "n", *versions, *[f"{v} - base" for v in versions[1:]]]
    return [text, "", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1),
            *[f"| {name} | {row.get('n')} | " + " | ".join(cells(row)) + " |" for name, row in skills.items()], ""]


def _kept_sentence(summary: dict[str, Any]) -> str:
    """What shadow validation kept, and whether it had to roll back."""
    best = summary.get("shadow_best")
    if not best:
        return ""
    text = (f" Shadow validation kept v{best['version']} (validation success {_fmt(best['success'])}, "
            f"n={best['n']}; RUN_DIR/policy/best)")
    if summary.get("kept_version") is not None and summary.get("heldout_kept_gain") is not None:
        text += (f": on the held-out tasks above, {_fmt(summary['heldout_kept'])}, a paired gain of "
                 f"{_fmt(summary['heldout_kept_gain'])} ± {_fmt(summary['heldout_kept_gain_stderr'])}")
    drops, rollbacks = summary.get("shadow_drops") or 0, summary.get("rollbacks") or []
    if drops:
        text += (f". {drops} scored version(s) fell below the top score beyond the margin (alert fired); "
                 + (", ".join(f"rolled back from v{r['from_version']} to v{r['to_version']} at step {r['step']}"
                              for r in rollbacks) or "no rollback"))
    return text + "."


def _cpu_lines(summary: dict[str, Any]) -> list[str]:
    """The 'Where the CPU went' section: cores each role kept busy, utilisation, idle ratios."""
    busy = summary.get("cpu_cores_busy")
    if not isinstance(busy, dict):
        return []
    cores, utilisation = summary.get("cores"), summary.get("cpu_utilisation")
    return ["## Where the CPU went", "",
            "CPU seconds of each role (user + system, all its threads) divided by the run's wall time: "
            f"the cores it kept busy, of {_fmt(cores)} available.", "",
            "| role | cores busy |", "|---|---:|", *[f"| {role} | {_fmt(value)} |" for role, value in busy.items()], "",
            f"Utilisation {_fmt(utilisation)} of the cores. The trainer waited for data "
            f"{_fmt(summary.get('trainer_idle_ratio'))} of its loop's time; samplers had no live episode "
            f"{_fmt(summary.get('sampler_idle_ratio'))} of theirs (mean over samplers). From sampling to "
            f"training: p50 {_fmt(summary.get('sampling_to_training_s_p50'))} s / "
            f"{_fmt(summary.get('sampling_to_training_steps_p50'))} versions, p95 "
            f"{_fmt(summary.get('sampling_to_training_s_p95'))} s / "
            f"{_fmt(summary.get('sampling_to_training_steps_p95'))} versions.", ""]


def trainer_phases(trainer: dict[str, Any], steps: list[StepRecord]) -> dict[str, float]:
    """The trainer's wall seconds by phase, from its progress file; `other` is the rest of its life (imports
    before start-up, intake, the ledger, progress files, the stop). The shadow scorer is a process of its own: only the trainer's
    snapshots for it are here."""
    startup = trainer.get("startup_s") if isinstance(trainer.get("startup_s"), dict) else {}
    phases = {"start-up (model, engine, checkpoint, clients)": sum(startup.values()),
              "waiting for a batch": sum(r.wait_s for r in steps),
              "forward and backward": sum(r.forward_backward_s for r in steps),
              "optimizer step": sum(r.optimizer_s for r in steps),
              "publishing versions": sum(r.publish_s for r in steps),
              "saving checkpoints": float(trainer.get("checkpoint_s") or 0.0),
              "snapshots for the shadow scorer": float(shadow_figures(trainer)["shadow_snapshot_s"] or 0.0)}
    wall = trainer.get("wall_s")
    if isinstance(wall, (int, float)):
        phases["other"] = max(wall - sum(phases.values()), 0.0)
    return phases


def sampler_phases(samplers: dict[str, dict]) -> dict[str, float]:
    """A sampler's wall seconds by phase (mean over samplers): with an episode live (generating, compressing,
    stepping the env, producing), loading versions, idle with none live, and start-up before its loop."""
    rows = [{key: float(s.get(key) or 0.0) for key in ("run_s", "wall_s", "idle_s", "reload_s")}
            for s in samplers.values() if all(isinstance(s.get(k), (int, float)) for k in ("run_s", "wall_s"))]
    if not rows:
        return {}
    return {"episodes live": mean([s["run_s"] - s["idle_s"] - s["reload_s"] for s in rows]),
            "loading versions": mean([s["reload_s"] for s in rows]),
            "idle, no episode live": mean([s["idle_s"] for s in rows]),
            "start-up": mean([s["wall_s"] - s["run_s"] for s in rows])}


def time_lines(trainer: dict[str, Any], samplers: dict[str, dict], steps: list[StepRecord]) -> list[str]:
    """The 'Where the time went' section: the trainer's and a sampler's wall seconds by phase."""
    lines = ["## Where the time went", "", "Wall seconds of each process by phase, from its progress file.", "",
             "| process | phase | seconds | share |", "|---|---|---:|---:|"]
    for process, phases in (("trainer", trainer_phases(trainer, steps)), ("sampler", sampler_phases(samplers))):
        total = sum(phases.values())
        lines += [f"| {process} | {name} | {_fmt(seconds)} | {_fmt(_ratio(seconds, total), '.0%')} |"
                  for name, seconds in phases.items()]
    scorer = shadow_figures(trainer)["shadow_scorer_cpu_s"]
    return [*lines, "", f"The shadow scorer, a process of its own, used {_fmt(scorer)} CPU seconds.", ""]


def _second_try_sentence(summary: dict[str, Any]) -> str:
    base, base_error, base_n, final, final_error, final_n, base_penalised, final_penalised = (
        summary.get(key) for key in SECOND_TRY_KEYS)
    if base_n is None and final_n is None:
        return ""
    repeats = (f" The env penalised {_fmt(base_penalised)} of the base model's second attempts and "
               f"{_fmt(final_penalised)} of the final version's (no new answer: a rejected one again, or none)."
               if base_penalised or final_penalised else "")
    return (f"After a wrong first answer, the second attempt was right {_fmt(base)} ± {_fmt(base_error)} of the time "
            f"for the base model (n = {_fmt(base_n)} tasks it got wrong first) and {_fmt(final)} ± {_fmt(final_error)} "
            f"for the final version (n = {_fmt(final_n)}); each over its own first-try failures, so not paired."
            + repeats)


def _attempts_table(groups: list[dict[str, Any]]) -> list[str]:
    if not groups:
        return []
    return ["Success per attempt of the same trajectories (second attempt: among those whose first one failed):",
            "", "| behaviour version | n | first attempt | s.e. | n (second) | second attempt | s.e. |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            *[f"| {g['version']} | {g['first_n']} | {_fmt(g['first_success'])} | {_fmt(g['first_stderr'])} | "
              f"{g['second_n']} | {_fmt(g['second_success'])} | {_fmt(g['second_stderr'])} |" for g in groups], ""]


def _version_table(groups: list[dict[str, Any]]) -> list[str]:
    if not groups:
        return ["No trained trajectories were recorded."]
    return ["| behaviour version | n | mean reward | s.e. |", "|---:|---:|---:|---:|",
            *[f"| {g['version']} | {g['n']} | {_fmt(g['mean'])} | {_fmt(g['stderr'])} |" for g in groups]]


def _markdown(run_dir: Path, summary: dict[str, Any], trainer: dict[str, Any], samplers: dict[str, dict],
              steps: list[StepRecord], max_staleness: Any) -> str:
    duration = summary.get("duration_s")
    trained = summary.get("trajectories_trained")
    rate = _ratio(trained, duration)
    staleness = finite(per_trajectory(steps, "staleness"))
    lines = [
        f"# sao run report: {run_dir.name}", "",
        f"Model `{summary.get('model', '?')}`, {_fmt(summary.get('tasks_fed'))} tasks, "
        f"{_fmt(summary.get('trainer_steps'))} optimizer steps in {_fmt(duration)} s. "
        f"Written {datetime.now().isoformat(timespec='seconds')} from `summary.json` and `status/`.", "",
        "## Summary", "", "What each figure means: docs/summary.md in sao's repository.", "",
        "| figure | value |", "|---|---:|", *[f"| {key} | {_fmt(value)} |" for key, value in summary.items()], "",
        "## What the run learned", "", _heldout_sentence(summary), "",
        *_skill_lines(summary),
        _second_try_sentence(summary), "",
        "![reward](plots/reward.png)", "",
        "Sampled reward of the trained trajectories, by the policy version that sampled them (the tasks "
        "differ from version to version, and sampling is not greedy: a trend, not a measurement):", "",
        *_version_table(summary.get("reward_by_version") or []), "",
        *_attempts_table(summary.get("attempts_by_version") or []),
        "## Throughput", "", "![throughput](plots/throughput.png)", "",
        f"{_fmt(trained)} trajectories trained in {_fmt(duration)} s ({_fmt(rate)} per second overall); "
        f"mean trainer step {_fmt(summary.get('trainer_step_s_mean'))} s, "
        f"{_fmt(summary.get('trainer_wait_s'))} s waiting for data in all"
        + (f", busy {_fmt(mean([r.busy_fraction for r in steps]))} of the time." if steps else "."), "",
        *_cpu_lines(summary),
        *time_lines(trainer, samplers, steps),
        "## Staleness", "", "![staleness](plots/staleness.png)", "",
        f"Mean staleness {_fmt(summary.get('staleness_mean'))} versions, at most "
        f"{_fmt(max(staleness) if staleness else None)} (budget `trainer.max_staleness` = {_fmt(max_staleness)}); "
        f"{_fmt(trainer.get('too_stale', 0))} trajectories were too stale to train on.", "",
        "## Compression", "", "![compression ratio](plots/compression_ratio.png)", "",
        f"Mean context compression ratio {_fmt(summary.get('compression_ratio'))} "
        "(bytes a trainer would receive with the full context at every step / bytes sao sends).", "",
        "## Training health", "", "![training](plots/training.png)", "",
        f"Mean importance ratio {_fmt(summary.get('importance_ratio_mean'))}, mean |rho - 1| "
        f"{_fmt(summary.get('importance_ratio_abs_dev_mean'))}, mean grad norm before clipping "
        f"{_fmt(summary.get('grad_norm_mean'))}.", "",
    ]
    if samplers:
        lines += ["## Samplers", "", "| sampler | produced | tokens | reloads | mean rollout s | policy version |",
                  "|---|---:|---:|---:|---:|---:|",
                  *[f"| {name} | {s.get('produced', 0)} | {s.get('tokens', 0)} | {s.get('reloads', 0)} | "
                    f"{_fmt(_ratio(s.get('rollout_s', 0.0), s.get('produced', 0)))} | {s.get('policy_version', 0)} |"
                    for name, s in samplers.items()], ""]
    progress = TrainerProgress.from_status(trainer)
    reasons = progress.dlq_reasons
    lines += ["## Dead letters", ""]
    if reasons:
        lines += ["| reason | count |", "|---|---:|", *[f"| {r} | {c} |" for r, c in sorted(reasons.items())]]
    else:
        lines.append("The trainer dead-lettered nothing.")
    task_reasons = progress.task_dlq_reasons
    lines += ["", f"Samplers dead-lettered {sum(task_reasons.values())} task(s), each counted once and never trained "
              "on: their trajectories never came, so they count as handled"
              + "".join(f"; {reason}: {count}" for reason, count in sorted(task_reasons.items())) + "."
              if task_reasons else "Samplers dead-lettered no task."]
    lines += ["", "Logs are in `logs/`, published weights in `policy/`, checkpoints in `checkpoints/`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sao.report RUN_DIR  (rewrites RUN_DIR/report.md and RUN_DIR/plots/)")
    print(write_report(Path(sys.argv[1])))  # noqa: T201 - the command's output
