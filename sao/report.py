"""End-of-run report: `report.md` and PNG plots in the run directory, from what the run recorded.

Reads only files: `summary.json`, `config.toml` and the progress files in `status/` (the
trainer's `history` holds per-trajectory and per-step series). So it works on any run
directory, also after the fact: `python -m sao.report RUN_DIR`. Series a run did not record
are left out of the text, and their plot says so, rather than failing the report.
"""

from __future__ import annotations

import json
import math
import sys
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

from sao.status import read_all_status, read_status

PLOTS = ("reward", "throughput", "staleness", "compression_ratio", "training")


def write_report(run_dir: Path, summary: dict[str, Any] | None = None) -> Path:
    """Write `run_dir/report.md` and `run_dir/plots/*.png`; return the report's path."""
    run_dir = Path(run_dir)
    if summary is None:
        summary = json.loads((run_dir / "summary.json").read_text())
    trainer = read_status(run_dir / "status" / "trainer.json")
    samplers = read_all_status(run_dir / "status", "sampler-")
    history = trainer.get("history", {})
    max_staleness = _config_value(run_dir, "trainer", "max_staleness")
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    _plot_all(history, max_staleness, plots_dir, summary.get("reward_window_size"))
    path = run_dir / "report.md"
    path.write_text(_markdown(run_dir, summary, trainer, samplers, history, max_staleness))
    return path


# --- series ------------------------------------------------------------------------------------

def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(values: list[Any]) -> float | None:
    finite = _finite(values)
    return sum(finite) / len(finite) if finite else None


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` finite values at each point (NaN where there are none)."""
    out = []
    for i in range(len(values)):
        recent = _finite(values[max(0, i - window + 1):i + 1])
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out


def _window(count: int) -> int:
    return max(1, count // 10)


def _cumulative_trajectories(history: dict[str, list]) -> list[float]:
    """Trajectories trained after each step: exact with per-step batch sizes, else spread evenly."""
    steps = len(history.get("trained_at", []))
    sizes = history.get("batch_size", [])
    if len(sizes) == steps:
        total, out = 0.0, []
        for size in sizes:
            total += size
            out.append(total)
        return out
    trained = len(history.get("reward", []))
    return [trained * (i + 1) / steps for i in range(steps)]


def _throughput(history: dict[str, list]) -> tuple[list[float], list[float], list[float]]:
    """(seconds since the first step, cumulative trajectories, trajectories/s since the previous step).

    The first step has no previous one, so its rate is NaN (not plotted).
    """
    trained_at = _finite(history.get("trained_at", []))
    if not trained_at:
        return [], [], []
    cumulative = _cumulative_trajectories(history)[:len(trained_at)]
    elapsed = [t - trained_at[0] for t in trained_at]
    rates = [float("nan")]
    for i in range(1, len(trained_at)):
        span = trained_at[i] - trained_at[i - 1]
        rates.append((cumulative[i] - cumulative[i - 1]) / span if span > 0 else float("nan"))
    return elapsed, cumulative, rates


# --- plots -------------------------------------------------------------------------------------

def _plot_all(history: dict[str, list], max_staleness: Any, plots_dir: Path, reward_window: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    def per_trajectory(name: str, key: str, ylabel: str, title: str, budget: float | None = None,
                       windows: int | None = None) -> None:
        fig, ax = plt.subplots(figsize=(8, 4))
        values = _finite(history.get(key, []))
        if values:
            x = list(range(1, len(values) + 1))
            ax.plot(x, values, ".", alpha=0.35, label="per trajectory")
            ax.plot(x, _rolling_mean(values, _window(len(values))), "-", label=f"rolling mean ({_window(len(values))})")
            if budget is not None:
                ax.axhline(budget, color="red", linestyle="--", label="trainer.max_staleness")
            if windows and 2 * windows <= len(values):  # the first and last windows summary.json compares
                for span, label in ((x[:windows], "first"), (x[-windows:], "last")):
                    mean = sum(values[span[0] - 1:span[-1]]) / windows
                    ax.hlines(mean, span[0], span[-1], colors="black", linewidth=2.5,
                              label=f"{label} {windows}: mean {mean:.3f}")
            ax.set_xlabel("trajectories trained")
            ax.legend(loc="best")
        else:
            _no_data(ax, key)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        _save(fig, plots_dir / f"{name}.png", plt)

    per_trajectory("reward", "reward", "total reward", "Reward of trained trajectories", windows=reward_window)
    per_trajectory("staleness", "staleness", "policy versions behind", "Staleness at training time",
                   float(max_staleness) if isinstance(max_staleness, (int, float)) else None)
    per_trajectory("compression_ratio", "compression_ratio", "naive / compressed context bytes",
                   "Context compression ratio")

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    elapsed, cumulative, rates = _throughput(history)
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
        values = history.get(key, [])
        if _finite(values):
            ax.plot(range(1, len(values) + 1), [v if isinstance(v, (int, float)) else float("nan") for v in values],
                    "-o", markersize=3)
        else:
            _no_data(ax, key)
        ax.set_ylabel(label)
    axes[0].set_title("Training health per step")
    axes[-1].set_xlabel("optimizer step")
    _save(fig, plots_dir / "training.png", plt)


def _no_data(ax, key: str) -> None:
    ax.text(0.5, 0.5, f"no '{key}' recorded in this run", ha="center", va="center", transform=ax.transAxes)


def _save(fig, path: Path, plt) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- text --------------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _config_value(run_dir: Path, section: str, key: str) -> Any:
    try:
        return tomllib.loads((run_dir / "config.toml").read_text()).get(section, {}).get(key)
    except (FileNotFoundError, tomllib.TOMLDecodeError):
        return None


def _markdown(run_dir: Path, summary: dict[str, Any], trainer: dict[str, Any], samplers: dict[str, dict],
              history: dict[str, list], max_staleness: Any) -> str:
    duration = summary.get("duration_s")
    trained = summary.get("trajectories_trained")
    rate = trained / duration if isinstance(trained, (int, float)) and duration else None
    staleness = _finite(history.get("staleness", []))
    lines = [
        f"# sao run report: {run_dir.name}",
        "",
        f"Model `{summary.get('model', '?')}`, {_fmt(summary.get('tasks_fed'))} tasks, "
        f"{_fmt(summary.get('trainer_steps'))} optimizer steps in {_fmt(duration)} s. "
        f"Written {datetime.now().isoformat(timespec='seconds')} from `summary.json` and `status/`.",
        "",
        "## Summary",
        "",
        "| figure | value |",
        "|---|---:|",
        *[f"| {key} | {_fmt(value)} |" for key, value in summary.items()],
        "",
        "## Reward",
        "",
        "![reward](plots/reward.png)",
        "",
        f"Mean reward of the first {_fmt(summary.get('reward_window_size'))} trajectories trained: "
        f"{_fmt(summary.get('reward_first_window'))}; of the last ones: {_fmt(summary.get('reward_last_window'))} "
        f"(gain {_fmt(summary.get('reward_gain'))} ± {_fmt(summary.get('reward_gain_stderr'))} standard error; "
        "one run is one sample - compare seeds before trusting a gain of under two standard errors).",
        "",
        "## Throughput",
        "",
        "![throughput](plots/throughput.png)",
        "",
        f"{_fmt(trained)} trajectories trained in {_fmt(duration)} s ({_fmt(rate)} per second overall); "
        f"mean trainer step {_fmt(summary.get('trainer_step_s_mean'))} s, "
        f"{_fmt(summary.get('trainer_wait_s'))} s waiting for data in all"
        + (f", busy {_fmt(_mean(history['busy_fraction']))} of the time." if history.get("busy_fraction") else "."),
        "",
        "## Staleness",
        "",
        "![staleness](plots/staleness.png)",
        "",
        f"Mean staleness {_fmt(summary.get('staleness_mean'))} versions, at most "
        f"{_fmt(max(staleness) if staleness else None)} (budget `trainer.max_staleness` = {_fmt(max_staleness)}); "
        f"{_fmt(trainer.get('too_stale', 0))} trajectories were too stale to train on.",
        "",
        "## Compression",
        "",
        "![compression ratio](plots/compression_ratio.png)",
        "",
        f"Mean context compression ratio {_fmt(summary.get('compression_ratio'))} "
        "(bytes a trainer would receive with the full context at every step / bytes sao sends).",
        "",
        "## Training health",
        "",
        "![training](plots/training.png)",
        "",
        f"Mean importance ratio {_fmt(summary.get('importance_ratio_mean'))}, mean |rho - 1| "
        f"{_fmt(summary.get('importance_ratio_abs_dev_mean'))}, mean grad norm before clipping "
        f"{_fmt(summary.get('grad_norm_mean'))}.",
        "",
    ]
    if samplers:
        lines += ["## Samplers", "", "| sampler | produced | tokens | reloads | mean rollout s | policy version |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, status in samplers.items():
            produced = status.get("produced", 0)
            rollout = status.get("rollout_s", 0.0) / produced if produced else None
            lines.append(f"| {name} | {produced} | {status.get('tokens', 0)} | {status.get('reloads', 0)} | "
                         f"{_fmt(rollout)} | {status.get('policy_version', 0)} |")
        lines.append("")
    reasons = trainer.get("dlq_reasons") or {}
    lines += ["## Dead letters", ""]
    if reasons:
        lines += ["| reason | count |", "|---|---:|", *[f"| {r} | {c} |" for r, c in sorted(reasons.items())]]
    else:
        lines.append("The trainer dead-lettered nothing.")
    lines += ["", "Logs are in `logs/`, published weights in `policy/`, checkpoints in `checkpoints/`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sao.report RUN_DIR  (rewrites RUN_DIR/report.md and RUN_DIR/plots/)")
    print(write_report(Path(sys.argv[1])))
