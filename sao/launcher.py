"""`sao run`: broker + topics + trainer + samplers, then feed and watch, then the summary.

Samplers and the trainer run as separate processes through the same CLI commands a cluster
deployment uses (`sao sampler`, `sao trainer`), so `sao run` exercises the production path.
They report progress through status files in the run directory; the launcher feeds tasks
(sao/feeder.py) and watches; then it scores the base model and the final version on held-out tasks
(sao/sampler/evaluation.py) and writes `summary.json`, `report.md` and plots (sao/report.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sao.config import SaoConfig, to_toml
from sao.feeder import Feeder
from sao.processes import die_with_parent
from sao.report import build_summary, summary_table, write_report
from sao.run_dir import RUNS, RunDir
from sao.status import (
    TrainerProgress,
    own_cpu_seconds,
    per_trajectory,
    process_cpu_seconds,
    read_all_status,
    read_status,
    trainer_steps,
    write_status,
)
from sao.transport.broker import EmbeddedBroker
from sao.transport.topics import ensure_topics, topic_partitions

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A process of the run died or the run timed out; the message says which and where its log is."""


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    """`sao ARGS` as a child that ends with this process, however it ends (a `sao run` killed by SIGKILL too).

    The run's processes share the machine's cores, so their OpenMP threads wait for work asleep
    (OMP_WAIT_POLICY=PASSIVE, unless set): spinning threads of one process took the cores another
    one's threads were waiting for, and a trainer step on shared cores burned CPU seconds waiting
    (benchmarks/HISTORY.md, "Where a default run's time went in fp32"). The shadow scorer inherits the trainer's.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log_path, "ab")
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    return subprocess.Popen([sys.executable, "-m", "sao.cli", *args], stdout=handle, stderr=subprocess.STDOUT,
                            env=env, preexec_fn=functools.partial(die_with_parent, os.getpid()))


def run(config: SaoConfig, console: Console) -> dict:
    """The whole story of a run: broker, topics, trainer, samplers; feed and watch; summary and report."""
    run_dir = RunDir(Path(config.run.run_dir or RUNS / datetime.now().strftime("%Y%m%d-%H%M%S")))
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    run_dir.config.write_text(to_toml(config))
    started, launcher_cpu_at_start = time.time(), own_cpu_seconds()
    broker = None
    broker_cpu_s: float | None = None
    bootstrap = config.broker.bootstrap_servers
    if bootstrap is None:
        broker = EmbeddedBroker(port=config.broker.embedded_port or None, log_path=run_dir.log("broker"),
                                die_with_parent=True)
        bootstrap = broker.start()
        console.print(f"embedded broker at [bold]{bootstrap}[/] (in-memory storage)")
    processes: dict[str, subprocess.Popen] = {}
    # SIGTERM must unwind like Ctrl-C so the finally below stops the children and the broker.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        ensure_topics(bootstrap, topic_partitions(config))
        processes = _start_processes(config, bootstrap, run_dir)
        _feed_and_watch(config, Feeder(config, bootstrap), run_dir, processes, console, started)
    finally:
        _stop_all(processes)
        if broker is not None:
            broker_cpu_s = process_cpu_seconds(broker.pid) if broker.pid else None  # read before it exits
            broker.stop()
    duration_s = time.time() - started  # training only: throughput figures must not count the evaluation
    # Where the CPU went (sao/report.py): the broker's and the launcher's share; the others write their own.
    write_status(run_dir.status("launcher"), {"cpu_s": own_cpu_seconds() - launcher_cpu_at_start,
                                              "broker_cpu_s": broker_cpu_s, "wall_s": duration_s,
                                              "cores": len(config.run_cpus(os.sched_getaffinity(0)))})
    _compare_on_heldout(config, run_dir, console)
    summary = build_summary(config, run_dir.root, duration_s)
    run_dir.summary.write_text(json.dumps(summary, indent=2))
    console.print(summary_table(summary, run_dir.root))
    report = write_report(run_dir.root, summary)
    console.print(f"run directory: [bold]{run_dir.root}[/] (summary.json, logs/, policy/, checkpoints/)")
    console.print(f"report: [bold]{report}[/] (plots in {run_dir.plots})")
    return summary


def _compare_on_heldout(config: SaoConfig, run_dir: RunDir, console: Console) -> None:
    """Base model vs final version, greedy, on the same held-out tasks (RUN_DIR/eval/heldout.json).

    The summary leads with this comparison. A failure here is reported but does not cost the
    run its summary; Ctrl-C skips it.
    """
    run_dir.heldout.unlink(missing_ok=True)  # a reused run directory must not report an earlier run's figures
    if not config.run.heldout_eval:
        return
    final = TrainerProgress.read(run_dir.status("trainer")).policy_version
    if not final:
        console.print("[yellow]no policy version was published: the held-out comparison is skipped[/]")
        return
    from sao.sampler.evaluation import best_version, compare  # torch and the model load only when a run gets here

    try:
        kept: int | None = best_version(run_dir.root)  # the version shadow validation kept
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or a board it cannot read
        kept = None

    console.print(f"held-out evaluation: base model v0 vs final v{final} on up to {config.run.heldout_cap} "
                  "tasks never trained on (greedy; Ctrl-C skips it) ...")
    try:
        # The trainer and samplers have exited: every CPU this process may use is free for this.
        result = compare(config, run_dir.root, final, threads=len(os.sched_getaffinity(0)), kept=kept)
    except KeyboardInterrupt:
        console.print("[yellow]held-out evaluation interrupted: the summary has no held-out figures[/]")
        return
    except (OSError, ValueError, RuntimeError) as err:
        log.exception("held-out evaluation failed")
        console.print(f"[red]held-out evaluation failed ({err}): the summary has no held-out figures[/]")
        return
    if not result["heldout_n"]:
        console.print(f"[red]the env failed on every held-out task: see {run_dir.heldout}[/]")
        return
    cached = ", the base's scores from the cache" if result["base_cached"] else ""
    console.print(f"held-out evaluation done: {result['heldout_n']} tasks in "
                  f"{result['base_seconds'] + result['final_seconds']:.0f} s{cached}; its figures lead the summary")


def _start_processes(config: SaoConfig, bootstrap: str, run_dir: RunDir) -> dict[str, subprocess.Popen]:
    """The trainer (told how many trajectories to expect) and `sampler.num_samplers` samplers."""
    common = ["--config", str(run_dir.config), "--bootstrap-servers", bootstrap, "--run-dir", str(run_dir.root)]
    expected = config.run.num_tasks * config.trainer.algorithm.copies_per_task
    processes = {"trainer": _spawn(["trainer", *common, "--expect", str(expected)], run_dir.log("trainer"))}
    for i in range(config.sampler.num_samplers):
        name = f"sampler-{i}"
        metrics_port = config.metrics.sampler_port + i if config.metrics.sampler_port else 0
        processes[name] = _spawn(["sampler", *common, "--sampler-id", name, "--metrics-port", str(metrics_port)],
                                 run_dir.log(name))
    return processes


def _feed_and_watch(config: SaoConfig, feeder: Feeder, run_dir: RunDir, processes: dict[str, subprocess.Popen],
                    console: Console, started: float) -> None:
    """Feed tasks under backpressure and show progress until the trainer exits; fail fast if a process dies."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}")]
    with Progress(*columns, console=console, transient=False) as bars:
        produced_bar = bars.add_task("produced", total=feeder.total, info="")
        trained_bar = bars.add_task("trained ", total=feeder.total, info="")
        last_progress, progressed_at = None, time.time()
        over_budget = False
        printed_at = time.time()
        while True:
            samplers = read_all_status(run_dir.status_dir, "sampler-")
            trainer = read_status(run_dir.status("trainer"))
            progress = TrainerProgress.from_status(trainer)
            over_budget = _over_budget(config, started, trainer, processes["trainer"], over_budget)
            if not over_budget and feeder.top_up(handled=progress.out_of_flight,
                                                 policy_version=progress.policy_version):
                # What the run fed, for `sao audit` to hold against a broker that may have lost it.
                write_status(run_dir.status("feeder"), {"mode": "sync" if feeder.sync else "async", "fed": feeder.fed,
                                                        **({"releases": feeder.releases} if feeder.sync else {})})
            produced = sum(s.get("produced", 0) for s in samplers.values())
            versions = ",".join(f"v{s.get('policy_version', 0)}" for s in samplers.values())
            bars.update(produced_bar, completed=produced, info=f"samplers on {versions or '-'}")
            recent = per_trajectory(trainer_steps(trainer), "rewards")[-16:]
            bars.update(trained_bar, completed=progress.trajectories_trained,
                        info=f"step {progress.step} policy v{progress.policy_version} "
                             f"reward(last 16) {sum(recent) / max(len(recent), 1):.2f}")
            printed_at = _plain_progress(console, printed_at, started, bars)
            if processes["trainer"].poll() is not None:
                break
            for name, proc in processes.items():
                if proc.poll() is not None and proc.returncode != 0:
                    raise RunFailed(f"{name} exited with code {proc.returncode}; see {run_dir.log(name)}")
            if config.run.timeout_s is not None and time.time() - started > config.run.timeout_s:
                raise RunFailed(f"run exceeded run.timeout_s={config.run.timeout_s:.0f} s; see {run_dir.logs}")
            now_progress = _progress(samplers, trainer)
            if now_progress != last_progress:
                last_progress, progressed_at = now_progress, time.time()
            elif time.time() - progressed_at > config.run.stall_timeout_s:
                raise RunFailed(f"nothing produced, trained or dead-lettered for {config.run.stall_timeout_s:.0f} s "
                                f"(run.stall_timeout_s); see {run_dir.logs}")
            # sync: every batch waits for this loop to notice the step, so it looks more often.
            time.sleep(0.1 if feeder.sync else 0.5)
    if processes["trainer"].returncode != 0:
        raise RunFailed(f"trainer exited with code {processes['trainer'].returncode}; see {run_dir.log('trainer')}")


def _over_budget(config: SaoConfig, started: float, trainer: dict, trainer_process: subprocess.Popen,
                 already: bool) -> bool:
    """Whether run.max_minutes is spent. Once it is, the feeder stops and the trainer gets SIGTERM, which it takes
    as a clean stop after its current step; only once it has written progress (its handler is then set)."""
    if already or config.run.max_minutes is None or time.time() - started < config.run.max_minutes * 60:
        return already
    if not trainer:
        return False
    log.info("run.max_minutes=%g spent: no more tasks are fed, and the trainer stops after its current step",
             config.run.max_minutes)
    trainer_process.send_signal(signal.SIGTERM)
    return True


PLAIN_PROGRESS_EVERY_S = 15.0  # where output is no terminal (CI, nohup, a file): one progress line this often


def _plain_progress(console: Console, printed_at: float, started: float, bars: Progress) -> float:
    """Where the console is no terminal, rich draws no live bars: print them as one line every
    PLAIN_PROGRESS_EVERY_S instead. Returns when a line was last printed."""
    now = time.time()
    if console.is_terminal or now - printed_at < PLAIN_PROGRESS_EVERY_S:
        return printed_at
    parts = [f"{task.description.strip()} {task.completed:.0f}/{task.total:.0f} {task.fields['info']}".strip()
             for task in bars.tasks]
    console.print(f"{now - started:.0f} s: " + "; ".join(parts), soft_wrap=True, highlight=False, markup=False)
    return now


def _progress(samplers: dict[str, dict], trainer: dict) -> tuple:
    """What changes while a run does work: a stall is a run where none of it changes."""
    sampler_work = sum(s.get("produced", 0) + s.get("dead_lettered", 0) for s in samplers.values())
    progress = TrainerProgress.from_status(trainer)
    scores = len((trainer.get("shadow") or {}).get("scores", {}))
    return sampler_work, progress.trajectories_trained, progress.dead_lettered, progress.step, scores


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
