"""Crash recovery: kill -9 a sampler and the trainer mid-run, restart them, and count what it cost.

    python benchmarks/recovery.py [--model smollm2-135m-instruct] [--tasks 64] [--batch-size 8] [--seed 0]
                                  [--timeout-s 3600] [--run-dir DIR] [--json PATH]

One run on an embedded broker, started as `sao run` starts it (sao/launcher.py: the same `sao trainer`
and `sao sampler` commands, tasks fed under the same backpressure), with two crashes, one after the other:

1. A sampler, once the trainer has taken its first step and a seeded random delay has passed: the first
   sampler that writes live episodes to its status file is killed (-9) right after, and a replacement
   is started. The killed episodes' elapsed time is the rollout a crash may cost. Generation seconds lost
   beyond it: every trajectory produced a second time (a task whose trajectory was delivered while an
   older task of its partition held the committed offset back, or one redone after a rebalance), at
   the rollout time of the redo.
2. The trainer, once the killed episodes' tasks are trained (the first crash has healed), at a seeded
   random step past its first checkpoint (checkpoint_every 2) and a random point of the step after it:
   kill -9, restart with `--resume`. Timed (headline): restart -> end of its first optimizer step, against
   the cold start -> first step of the same run (baseline). Nothing is generated again: what the trainer
   held is re-read from Kafka from the checkpoint's offsets; those trajectories' rollout seconds are what
   an in-memory buffer would have had to regenerate (verl's RFC #7579 measures 2,400-4,000 s per crash).

Then the audit (sao/audit.py) accounts for every task fed: `lost` and `trained_twice` must be 0 (the
script exits 1 otherwise). Tasks are fed in three stages so that the trainer cannot outrun a crash: all but
the last three batches at first; two more once the killed episodes are trained (otherwise a slow redo
could leave the trainer no step past a checkpoint to be killed at); the last only after the trainer
crash, so the run cannot end before both. Times are wall-clock on whatever else the machine runs: the
load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
from rich.console import Console
from rich.table import Table

from sao.audit import AuditReport, audit, read_ledger, report_table
from sao.config import SaoConfig, load_config, to_toml
from sao.feeder import Feeder
from sao.launcher import RunFailed, _spawn, _start_processes, _stop_all
from sao.run_dir import RunDir
from sao.schema import SchemaError, Trajectory, decode
from sao.status import read_status
from sao.transport.broker import EmbeddedBroker
from sao.transport.kafka import iter_all
from sao.transport.topics import ensure_topics, topic_partitions

CHECKPOINT_EVERY = 2  # an early checkpoint, so that a short run can kill the trainer past one
WITHHELD_BATCHES = 3  # fed only once the sampler crash has healed: room for a kill past a checkpoint
POLL_S = 0.02  # status files are read this often: a kill lands about this long after the moment chosen
FEED_EVERY_S = 0.5


class CrashRun:
    """The run and its two crashes; `run()` returns the timings and what each crash held."""

    def __init__(self, config: SaoConfig, bootstrap: str, run_dir: RunDir, rng: np.random.Generator):
        self.config, self.bootstrap, self.run_dir, self.rng = config, bootstrap, run_dir, rng
        self.feeder = Feeder(config, bootstrap)
        self.total = self.feeder.total
        self.full_steps = self.total // config.trainer.batch_size
        if self.full_steps < WITHHELD_BATCHES + 1:
            raise RunFailed(f"too few tasks for both crashes: {self.full_steps} trainer steps, at least "
                            f"{WITHHELD_BATCHES + 1} needed; pass more --tasks")
        # Fed in three stages (see the docstring): the trainer cannot outrun either crash.
        self.feeder.total -= WITHHELD_BATCHES * config.trainer.batch_size
        self.processes: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()
        self.fed_at = 0.0
        self.deadline = 0.0

    def run(self) -> dict:
        started = time.time()
        self.deadline = time.monotonic() + self.config.run.timeout_s
        self.processes = _start_processes(self.config, self.bootstrap, self.run_dir)
        try:
            cold = self._first_step(started, "the trainer's first step")
            sampler = self._crash_a_sampler(cold["step_s"])
            trainer = self._crash_the_trainer(sampler)
            self._until(lambda: self.processes["trainer"].poll() is not None, "the end of the run", may_end=True)
        finally:
            _stop_all(self.processes)
        if self.processes["trainer"].returncode != 0:
            raise RunFailed(f"the resumed trainer exited with code {self.processes['trainer'].returncode}; "
                            f"see {self.run_dir.log('trainer')}")
        return {"cold_start": cold, "sampler_crash": sampler, "trainer_crash": trainer, "wall_s": time.time() - started}

    # --- the two crashes ------------------------------------------------------------------------

    def _crash_a_sampler(self, step_s: float) -> dict:
        """Kill -9 the first sampler seen with live episodes after a random delay; start a replacement."""
        armed = time.time() + float(self.rng.uniform(0, 1)) * step_s
        found: dict = {}

        def live_now() -> bool:
            if time.time() < armed:
                return False
            for name in self._samplers():
                status = read_status(self.run_dir.status(name))
                if status.get("live_episodes") and status.get("updated_at", 0) > armed:
                    found.update(name=name, status=status)
                    return True
            return False

        self._until(live_now, "a sampler with live episodes")
        victim, status = found["name"], found["status"]
        killed_at = self._kill(victim)
        replacement = f"{victim}-replacement"
        replaced_at = time.time()
        self.processes[replacement] = _spawn(["sampler", *self._common(), "--sampler-id", replacement,
                                              "--metrics-port", "0"], self.run_dir.log(replacement))
        return {"victim": victim, "killed_at": killed_at, "status_age_s": killed_at - status["updated_at"],
                "live_episodes": status["live_episodes"], "trainer_step": self._trainer_status().get("step", 0),
                "replacement": replacement, "replaced_at": replaced_at}

    def _crash_the_trainer(self, sampler: dict) -> dict:
        """Once the killed episodes are trained: kill -9 the trainer past its first checkpoint, then resume it."""
        killed_ids = {Trajectory.make_id(e["task_id"], e["copy"]) for e in sampler["live_episodes"]}
        self._until(lambda: killed_ids <= set(read_ledger(self.run_dir.ledger).times_trained()),
                    "training of the killed episodes' tasks")
        self.feeder.total = self.total - self.config.trainer.batch_size  # all but the last batch
        low = max(self.config.trainer.checkpoint_every, self._trainer_status().get("step", 0) + 1)
        high = self.full_steps - 2  # the last batch, still withheld, leaves it at least this far to go
        if low > high:
            raise RunFailed(f"too few tasks for both crashes: the trainer would be killed at step {low} of "
                            f"{self.full_steps}; pass more --tasks")
        kill_step = int(self.rng.integers(low, high + 1))
        self._until(lambda: self._trainer_status().get("step", 0) >= kill_step, f"trainer step {kill_step}")
        last = self._trainer_status()["steps"][-1]
        into_next = float(self.rng.uniform(0, 1)) * (last["wait_s"] + last["step_s"] + last["publish_s"])
        until = time.monotonic() + into_next
        self._until(lambda: time.monotonic() >= until, "the kill moment")
        at_kill = self._trainer_status()
        checkpoint = self.run_dir.latest_checkpoint.read_text().strip()
        killed_at = self._kill("trainer")
        self.feeder.total = self.total  # the last batch
        restarted_at = time.time()
        self.processes["trainer"] = _spawn(["trainer", *self._common(), "--expect", str(self.total), "--resume"],
                                           self.run_dir.log("trainer"))
        self.killed.discard("trainer")
        first = self._first_step(restarted_at, "the resumed trainer's first step")
        return {"killed_at": killed_at, "step_at_kill": at_kill.get("step"), "chosen_step": kill_step,
                "seconds_into_next_step": into_next, "checkpoint": checkpoint,
                "version_at_kill": at_kill.get("policy_version"), "restarted_at": restarted_at, **first}

    # --- plumbing -------------------------------------------------------------------------------

    def _first_step(self, since: float, what: str) -> dict:
        """The first optimizer step that ended after `since` (a life's first step), timed from `since`."""
        record: dict = {}

        def reached() -> bool:
            steps = self._trainer_status().get("steps", [])
            if steps and steps[0]["trained_at"] > since:
                record.update(steps[0])
            return bool(record)

        self._until(reached, what)
        ended = record["trained_at"] - record["publish_s"]  # the record is written after the publish
        collecting = ended - record["step_s"] - record["wait_s"]
        return {"to_first_step_s": ended - since, "start_up_s": collecting - since, "wait_s": record["wait_s"],
                "start_up_phases_s": self._trainer_status().get("startup_s", {}),
                "step_s": record["step_s"], "step": record["step"], "policy_version": record["policy_version"]}

    def _until(self, condition, what: str, may_end: bool = False) -> None:
        """Feed and watch until `condition()`; fail if a process dies, the trainer ends first, or time runs out."""
        while not condition():
            if time.monotonic() - self.fed_at > FEED_EVERY_S:
                self._feed()
            for name, process in self.processes.items():
                if name not in self.killed and process.poll() is not None and process.returncode != 0:
                    raise RunFailed(f"{name} exited with code {process.returncode}; see {self.run_dir.log(name)}")
            if not may_end and self.processes["trainer"].poll() is not None:
                raise RunFailed(f"the trainer finished before {what}; see {self.run_dir.log('trainer')}")
            if time.monotonic() > self.deadline:
                raise RunFailed(f"no {what} within run.timeout_s; see {self.run_dir.logs}")
            time.sleep(POLL_S)

    def _feed(self) -> None:
        # The ledger's surviving history, not the status file: a killed trainer's count would be rolled back.
        # Dead letters count as handled: the trainer's own, and tasks a sampler dead-lettered (sao/transport/dlq.py).
        status = self._trainer_status()
        handled = (len(read_ledger(self.run_dir.ledger).times_trained()) + status.get("dead_lettered", 0)
                   + status.get("tasks_dead_lettered", 0))
        self.feeder.top_up(handled)
        self.fed_at = time.monotonic()

    def _kill(self, name: str) -> float:
        process = self.processes[name]
        killed_at = time.time()
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        self.killed.add(name)
        return killed_at

    def _samplers(self) -> list[str]:
        return [name for name in self.processes if name != "trainer" and name not in self.killed]

    def _trainer_status(self) -> dict:
        return read_status(self.run_dir.status("trainer"))

    def _common(self) -> list[str]:
        return ["--config", str(self.run_dir.config), "--bootstrap-servers", self.bootstrap,
                "--run-dir", str(self.run_dir.root)]


# --- figures from the topics, the ledger and the audit ---------------------------------------------

def productions(bootstrap: str, topic: str) -> list[dict]:
    """Every trajectory message on `topic` (a redo included), oldest first."""
    found = []
    for msg in iter_all(bootstrap, topic, timeout=120, quiet_period=1.0):
        try:
            trajectory = decode(msg.value(), Trajectory)
        except SchemaError:
            continue  # the audit counts undecodable messages
        found.append({"id": trajectory.trajectory_id, "sampler": trajectory.sampler_id,
                      "created_at": trajectory.created_at, "rollout_s": trajectory.timings.get("rollout_s", 0.0)})
    return sorted(found, key=lambda p: p["created_at"])


def regenerated(produced: list[dict]) -> list[dict]:
    """Each production of a trajectory id after its first (by creation time): generation done again."""
    first: dict[str, dict] = {}
    again = []
    for production in sorted(produced, key=lambda p: p["created_at"]):
        if production["id"] in first:
            again.append({**production, "first_by": first[production["id"]]["sampler"]})
        else:
            first[production["id"]] = production
    return again


def trained_after_resume(ledger: Path) -> set[str]:
    """Trajectory ids trained by the steps logged after the (last) resume marker."""
    ids: set[str] = set()
    for line in ledger.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line the kill cut short (the audit counts it)
        if "resumed_from_step" in record:
            ids.clear()
        ids.update(record.get("trajectory_ids", []))
    return ids


def audit_figures(report: AuditReport) -> dict:
    """What the benchmark reports from the audit: lost = fed copies neither trained nor dead-lettered
    once the run is over; trained twice = trained more often than trainer.max_reuse."""
    return {"lost": len(report.lost_produced) + len(report.lost_not_produced),
            "trained_twice": len(report.trained_twice), "clean": report.clean, "finished": report.finished,
            "fed": report.fed, "trained": report.trained, "dead_lettered": report.dead_lettered,
            "ledger": report.ledger, "notes": report.notes}


def sampler_figures(crash: dict, produced: list[dict], again: list[dict], trainer_killed_at: float) -> dict:
    victim, killed_at = crash["victim"], crash["killed_at"]
    by_victim = {p["id"] for p in produced if p["sampler"] == victim}
    # An episode may have ended between the status write and the kill: then it was not killed.
    killed = [e for e in crash["live_episodes"] if Trajectory.make_id(e["task_id"], e["copy"]) not in by_victim]
    elapsed = [killed_at - e["started_at"] for e in killed]
    redo = {p["id"]: p for p in produced if p["created_at"] > killed_at}
    redone = [redo.get(Trajectory.make_id(e["task_id"], e["copy"]), {}).get("rollout_s", float("nan"))
              for e in killed]
    beyond = [r for r in again if killed_at < r["created_at"] < trainer_killed_at]
    replacement = [p["created_at"] for p in produced if p["sampler"] == crash["replacement"]]
    return {"victim": victim, "killed_episodes": len(killed), "killed_rollout_s": sum(elapsed),
            "killed_rollout_wall_s": max(elapsed, default=0.0), "redo_rollout_s": sum(redone),
            "produced_again": len(beyond), "generation_seconds_lost": sum(r["rollout_s"] for r in beyond),
            "replacement_to_first_trajectory_s": (min(replacement) - crash["replaced_at"]) if replacement else None,
            "status_age_at_kill_s": crash["status_age_s"], "trainer_step_at_kill": crash["trainer_step"]}


def trainer_figures(crash: dict, cold: dict, produced: list[dict], again: list[dict], after_resume: set[str],
                    rolled_back_steps: int) -> dict:
    killed_at = crash["killed_at"]
    reread = [p for p in produced if p["created_at"] < killed_at and p["id"] in after_resume]
    beyond = [r for r in again if r["created_at"] > killed_at]
    return {"step_at_kill": crash["step_at_kill"], "checkpoint": crash["checkpoint"],
            "seconds_into_next_step": crash["seconds_into_next_step"], "rolled_back_steps": rolled_back_steps,
            "restart_to_first_step_s": crash["to_first_step_s"], "restart_start_up_s": crash["start_up_s"],
            "restart_wait_s": crash["wait_s"], "restart_step_s": crash["step_s"],
            "restart_start_up_phases_s": crash["start_up_phases_s"], "cold_start_up_phases_s": cold["start_up_phases_s"],
            "cold_to_first_step_s": cold["to_first_step_s"], "cold_start_up_s": cold["start_up_s"],
            "cold_wait_s": cold["wait_s"], "cold_step_s": cold["step_s"],
            "reread_from_kafka": len(reread), "reread_rollout_s": sum(p["rollout_s"] for p in reread),
            "produced_again": len(beyond), "generation_seconds_lost": sum(r["rollout_s"] for r in beyond)}


def _phases(seconds: dict[str, float]) -> str:
    return ", ".join(f"{phase} {value:.1f}" for phase, value in seconds.items()) + " s" if seconds else "n/a"


# --- the script -------------------------------------------------------------------------------------

def bench_config(model: str, tasks: int, batch_size: int, seed: int, run_dir: Path) -> SaoConfig:
    config = load_config(overrides=[f'policy.model="{model}"'], environ={})
    config.run.num_tasks, config.run.run_dir, config.run.heldout_eval = tasks, str(run_dir), False
    config.env.seed = seed
    config.trainer.batch_size, config.trainer.checkpoint_every = batch_size, CHECKPOINT_EVERY
    config.metrics.trainer_port = config.metrics.sampler_port = config.metrics.launcher_port = 0  # never collide
    return config


def measure(config: SaoConfig, run_dir: RunDir, seed: int) -> dict:
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with EmbeddedBroker(log_path=run_dir.log("broker")) as broker:
        bootstrap = broker.bootstrap_servers
        config.broker.bootstrap_servers = bootstrap
        run_dir.config.write_text(to_toml(config))
        ensure_topics(bootstrap, topic_partitions(config))
        timeline = CrashRun(config, bootstrap, run_dir, np.random.default_rng(seed)).run()
        report = audit(config, run_dir, bootstrap, finished=True, quiet_period=1.0)
        produced = productions(bootstrap, config.topics.trajectories)
    again = regenerated(produced)
    trainer = trainer_figures(timeline["trainer_crash"], timeline["cold_start"], produced, again,
                              trained_after_resume(run_dir.ledger), report.ledger["rolled_back_steps"])
    sampler = sampler_figures(timeline["sampler_crash"], produced, again, timeline["trainer_crash"]["killed_at"])
    figures = audit_figures(report)
    restart, cold = trainer["restart_to_first_step_s"], trainer["cold_to_first_step_s"]
    return {
        "headline": {"metric": "seconds from trainer restart to its first optimizer step", "unit": "s",
                     "value": restart, "baseline": cold, "ratio": restart / cold,
                     "baseline_is": "the same run's trainer cold start -> first optimizer step"},
        "lost": figures["lost"], "trained_twice": figures["trained_twice"],
        "generation_seconds_lost": sum(r["rollout_s"] for r in again),  # beyond the killed rollout
        "trainer_crash": trainer, "sampler_crash": sampler, "audit": figures,
        "regenerated": again, "produced": len(produced), "wall_s": timeline["wall_s"],
        "settings": {"model": config.policy.model, "tasks": config.run.num_tasks, "seed": seed,
                     "batch_size": config.trainer.batch_size, "checkpoint_every": config.trainer.checkpoint_every,
                     "samplers": config.sampler.num_samplers, "rollout_batch": config.sampler.rollout_batch},
        "cores": os.cpu_count(), "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "_report": report,
    }


def print_result(console: Console, result: dict) -> None:
    trainer, sampler = result["trainer_crash"], result["sampler_crash"]
    table = Table(title=f"crash recovery, {result['settings']['model']}, {result['settings']['tasks']} tasks")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("trainer: killed at step (checkpoint)", f"{trainer['step_at_kill']} ({trainer['checkpoint']}), "
                                                 f"+{trainer['seconds_into_next_step']:.1f} s"),
        ("trainer: restart -> first optimizer step", f"{trainer['restart_to_first_step_s']:.1f} s"),
        ("  start-up / wait for a batch / step", f"{trainer['restart_start_up_s']:.1f} / {trainer['restart_wait_s']:.1f}"
                                                 f" / {trainer['restart_step_s']:.1f} s"),
        ("  start-up phases after imports", _phases(trainer["restart_start_up_phases_s"])),
        ("trainer: cold start -> first step (baseline)", f"{trainer['cold_to_first_step_s']:.1f} s"),
        ("  start-up / wait for a batch / step", f"{trainer['cold_start_up_s']:.1f} / {trainer['cold_wait_s']:.1f}"
                                                 f" / {trainer['cold_step_s']:.1f} s"),
        ("trainer: steps rolled back and trained again", str(trainer["rolled_back_steps"])),
        ("trainer: re-read from Kafka (rollout s an in-memory buffer loses)",
         f"{trainer['reread_from_kafka']} ({trainer['reread_rollout_s']:.1f} s)"),
        ("trainer: generation seconds lost", f"{trainer['generation_seconds_lost']:.1f} s"),
        ("sampler: killed episodes (episode-s, wall s)", f"{sampler['killed_episodes']} "
         f"({sampler['killed_rollout_s']:.1f}, {sampler['killed_rollout_wall_s']:.1f} s)"),
        ("sampler: produced again beyond the killed rollout", f"{sampler['produced_again']} "
                                                              f"({sampler['generation_seconds_lost']:.1f} s)"),
        ("generation seconds lost beyond the killed rollout", f"{result['generation_seconds_lost']:.1f} s"),
        ("lost / trained twice (audit)", f"{result['lost']} / {result['trained_twice']}"),
        ("load average (1 min) before / after", f"{result['load_average_1m']['before']:.1f} / "
                                                f"{result['load_average_1m']['after']:.1f} on {result['cores']} cores"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"restart / cold start: {result['headline']['ratio']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="trainer.batch_size")
    parser.add_argument("--seed", type=int, default=0, help="of the task stream and of the kill moments")
    parser.add_argument("--timeout-s", type=float, default=3600, help="run.timeout_s: give up after this long")
    parser.add_argument("--run-dir", type=Path, help="keep the run here (default: a temporary folder, removed)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    console = Console()
    with tempfile.TemporaryDirectory(prefix="sao-recovery-") as scratch:
        run_dir = RunDir(args.run_dir or Path(scratch))
        config = bench_config(args.model, args.tasks, args.batch_size, args.seed, run_dir.root)
        config.run.timeout_s = args.timeout_s
        try:
            result = measure(config, run_dir, args.seed)
        except RunFailed as err:
            for log in sorted(run_dir.logs.glob("*.log")):
                console.print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-2000:]}")
            console.print(f"[red]recovery benchmark failed:[/] {err}")  # last: a test's output tail shows it
            sys.exit(2)
    console.print(report_table(result.pop("_report")))
    print_result(console, result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if result["lost"] or result["trained_twice"]:
        console.print("[red]the audit found trajectories lost or trained twice[/]")
        sys.exit(1)


if __name__ == "__main__":
    main()
