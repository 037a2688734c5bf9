"""`sao run`: broker + topics + task feeder + samplers + trainer, one command, one summary.

Samplers and the trainer run as separate processes through the same CLI commands a cluster
deployment uses (`sao sampler`, `sao trainer`), so `sao run` exercises the production path.
They report progress through status files in the run directory; the launcher only watches,
then writes `summary.json`, `report.md` and its plots, and prints where they are.
"""

from __future__ import annotations

import json
import logging
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sao.config import SaoConfig, to_toml
from sao.envs.registry import env_class, make_tasks
from sao.metrics import record_feed
from sao.report import write_report
from sao.schema import encode
from sao.status import read_all_status, read_status
from sao.transport.broker import EmbeddedBroker
from sao.transport.kafka import make_producer
from sao.transport.topics import ensure_topics

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A process of the run died or the run timed out; the message says which and where its log is."""


def new_run_dir(config: SaoConfig) -> Path:
    if config.run.run_dir:
        return Path(config.run.run_dir)
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def topic_partitions(config: SaoConfig) -> dict[str, int]:
    t = config.topics
    # One policy partition keeps announcements totally ordered.
    return {t.tasks: t.task_partitions, t.trajectories: t.trajectory_partitions, t.policy: 1, t.dlq: 1}


def attempts_per_task(config: SaoConfig) -> int:
    """SAO samples each task once; the GRPO baseline samples it group_size times."""
    return config.trainer.group_size if config.trainer.algorithm == "grpo" else 1


def feed_tasks(config: SaoConfig, bootstrap: str, count: int, start_index: int = 0, producer=None) -> int:
    """Produce tasks [start_index, start_index + count), each `attempts_per_task` times (acks=all).

    Returns how many task messages (= trajectories to expect) were acknowledged.
    """
    producer = producer or make_producer(bootstrap)
    sent = 0
    for task in make_tasks(config.env, count, start_index):
        for attempt in range(attempts_per_task(config)):
            message = replace(task, attempt=attempt)  # attempt makes the trajectory_id distinct
            producer.produce(config.topics.tasks, value=encode(message), key=task.task_id)
            producer.poll(0)
            sent += 1
    undelivered = producer.flush(30)
    if undelivered:
        raise RunFailed(f"{undelivered} tasks were not acknowledged by the broker at {bootstrap}")
    return sent


def in_flight_cap(config: SaoConfig) -> int:
    """Trajectories fed but not yet trained on, at most (never less than one task's attempts).

    SAO: 2 batches, so samplers stay busy while the trainer steps, and staleness stays near 1.
    GRPO: one batch, i.e. synchronous - the next batch is sampled only with the new policy.
    """
    default = config.trainer.batch_size * (1 if config.trainer.algorithm == "grpo" else 2)
    return max(config.run.max_tasks_in_flight or default, attempts_per_task(config))


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "sao.cli", *args], stdout=handle, stderr=subprocess.STDOUT)


def run(config: SaoConfig, console: Console) -> dict:
    env_class(config.env.name)  # a bad env.name fails here, before any process starts
    run_dir = new_run_dir(config)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    config_path.write_text(to_toml(config))
    started = time.time()
    broker = None
    if config.broker.bootstrap_servers is None:
        broker = EmbeddedBroker(port=config.broker.embedded_port or None, log_path=run_dir / "logs" / "broker.log")
        bootstrap = broker.start()
        console.print(f"embedded broker at [bold]{bootstrap}[/] (in-memory storage)")
    else:
        bootstrap = config.broker.bootstrap_servers
    processes: dict[str, subprocess.Popen] = {}
    # SIGTERM must unwind like Ctrl-C so the finally below stops the children and the broker.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        ensure_topics(bootstrap, topic_partitions(config))
        common = ["--config", str(config_path), "--bootstrap-servers", bootstrap, "--run-dir", str(run_dir)]
        expected = config.run.num_tasks * attempts_per_task(config)
        processes["trainer"] = _spawn(["trainer", *common, "--expect", str(expected)],
                                      run_dir / "logs" / "trainer.log")
        for i in range(config.sampler.num_samplers):
            metrics_port = config.metrics.sampler_port + i if config.metrics.sampler_port else 0
            processes[f"sampler-{i}"] = _spawn(["sampler", *common, "--sampler-id", f"sampler-{i}",
                                                "--metrics-port", str(metrics_port)],
                                               run_dir / "logs" / f"sampler-{i}.log")
        _watch(config, bootstrap, run_dir, processes, console, started)
    finally:
        _stop_all(processes)
        if broker is not None:
            broker.stop()
    summary = build_summary(config, run_dir, time.time() - started)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(summary_table(summary))
    report = write_report(run_dir, summary)
    console.print(f"run directory: [bold]{run_dir}[/] (summary.json, logs/, policy/, checkpoints/)")
    console.print(f"report: [bold]{report}[/] (plots in {report.parent / 'plots'})")
    return summary


def _watch(config: SaoConfig, bootstrap: str, run_dir: Path, processes: dict[str, subprocess.Popen],
           console: Console, started: float) -> None:
    """Feed tasks under backpressure and show progress until the trainer exits; fail fast if a process dies."""
    attempts = attempts_per_task(config)
    total = config.run.num_tasks * attempts  # trajectories
    cap = in_flight_cap(config)
    producer = make_producer(bootstrap)
    fed = 0
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}")]
    with Progress(*columns, console=console, transient=False) as progress:
        produced_bar = progress.add_task("produced", total=total, info="")
        trained_bar = progress.add_task("trained ", total=total, info="")
        while True:
            samplers = read_all_status(run_dir / "status", "sampler-")
            trainer = read_status(run_dir / "status" / "trainer.json")
            produced = sum(s.get("produced", 0) for s in samplers.values())
            versions = ",".join(f"v{s.get('policy_version', 0)}" for s in samplers.values())
            progress.update(produced_bar, completed=produced, info=f"samplers on {versions or '-'}")
            trained = trainer.get("trajectories_trained", 0) + trainer.get("dead_lettered", 0)
            # Backpressure: samplers never run more than `cap` trajectories ahead of the
            # trainer, which bounds staleness instead of producing work that goes stale.
            wave = min(total - fed, cap - (fed - trained)) // attempts  # whole tasks
            sent = feed_tasks(config, bootstrap, wave, start_index=fed // attempts, producer=producer) if wave > 0 else 0
            fed += sent
            record_feed(sent, fed - trained)
            rewards = trainer.get("history", {}).get("reward", [])
            recent = rewards[-16:]
            progress.update(trained_bar, completed=trainer.get("trajectories_trained", 0),
                            info=f"step {trainer.get('step', 0)} policy v{trainer.get('policy_version', 0)} "
                                 f"reward(last 16) {sum(recent) / max(len(recent), 1):.2f}")
            if processes["trainer"].poll() is not None:
                break
            for name, proc in processes.items():
                if proc.poll() is not None and proc.returncode != 0:
                    raise RunFailed(f"{name} exited with code {proc.returncode}; see {run_dir / 'logs' / (name + '.log')}")
            if time.time() - started > config.run.timeout_s:
                raise RunFailed(f"run exceeded run.timeout_s={config.run.timeout_s:.0f} s; see {run_dir / 'logs'}")
            time.sleep(0.5)
    if processes["trainer"].returncode != 0:
        raise RunFailed(f"trainer exited with code {processes['trainer'].returncode}; see {run_dir / 'logs' / 'trainer.log'}")


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _stop_all(processes: dict[str, subprocess.Popen], timeout: float = 20.0) -> None:
    for proc in processes.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.time() + timeout
    for proc in processes.values():
        try:
            proc.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _gain_stderr(first: list[float], last: list[float]) -> float | None:
    """Standard error of mean(last) - mean(first), the windows taken as independent samples."""
    if len(first) < 2 or len(last) < 2:
        return None
    return (statistics.variance(first) / len(first) + statistics.variance(last) / len(last)) ** 0.5


def build_summary(config: SaoConfig, run_dir: Path, duration_s: float) -> dict:
    samplers = read_all_status(run_dir / "status", "sampler-")
    trainer = read_status(run_dir / "status" / "trainer.json")
    history = trainer.get("history", {})
    rewards = history.get("reward", [])
    window = max(1, int(len(rewards) * config.run.reward_window))
    versions = history.get("behaviour_version", [])
    return {
        "trajectories_produced": sum(s.get("produced", 0) for s in samplers.values()),
        "trajectories_trained": len(rewards),
        "duplicates_dropped": trainer.get("duplicates", 0),
        "tasks_fed": config.run.num_tasks,
        "algorithm": config.trainer.algorithm if config.trainer.algorithm == "sao" else f"grpo (group {config.trainer.group_size})",
        "trainer_steps": trainer.get("step", 0),
        "policy_version": trainer.get("policy_version", 0),
        "max_behaviour_version": max(versions, default=0),
        "trajectories_from_reloaded_policy": sum(1 for v in versions if v > 0),
        "sampler_reloads": sum(s.get("reloads", 0) for s in samplers.values()),
        "reward_first_window": _mean(rewards[:window]),
        "reward_last_window": _mean(rewards[-window:]),
        "reward_window_size": window,
        "reward_gain": None if not rewards else _mean(rewards[-window:]) - _mean(rewards[:window]),
        "reward_gain_stderr": _gain_stderr(rewards[:window], rewards[-window:]),
        "compression_ratio": _mean(history.get("compression_ratio", [])),
        "importance_ratio_mean": _mean(history.get("ratio_mean", [])),
        "importance_ratio_abs_dev_mean": _mean(history.get("ratio_abs_dev", [])),
        "grad_norm_mean": _mean(history.get("grad_norm", [])),
        "staleness_mean": _mean(history.get("staleness", [])),
        "dead_lettered": trainer.get("dead_lettered", 0) + sum(s.get("dead_lettered", 0) for s in samplers.values()),
        "trainer_wait_s": trainer.get("wait_s"),
        "trainer_step_s_mean": _mean(history.get("step_s", [])),
        "duration_s": duration_s,
        "model": config.policy.model,
    }


def summary_table(summary: dict) -> Table:
    table = Table(title="sao run summary", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        table.add_row(key, text)
    return table
