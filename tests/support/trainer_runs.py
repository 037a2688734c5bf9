"""Synthetic trajectories and trainer runs for trainer tests (no sampler, no LM rollout needed)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from sao.compression.bottleneck import resolve_bottleneck
from sao.schema import Memory, Step, Trajectory, encode
from sao.transport.dlq import describe_dlq_message
from sao.transport.kafka import make_producer, read_all
from sao.transport.topics import ensure_topics

TOTAL = 18  # unique trajectories; plus one duplicate and one malformed message
# How memory travels by default (compression.bottleneck = "auto"): what a default trainer reads.
SHIPPED_BASIS = resolve_bottleneck("auto", "all-MiniLM-L6-v2")


def synthetic_trajectory(index: int, rng: np.random.Generator) -> Trajectory:
    """A valid trajectory for the tiny model (random tokens, plausible behaviour log-probs)."""
    steps = []
    for _ in range(int(rng.integers(1, 3))):
        length = int(rng.integers(2, 6))
        steps.append(Step(observation_ids=rng.integers(3, 49152, 4).astype(np.int32),
                          action_ids=rng.integers(3, 49152, length).astype(np.int32),
                          behaviour_logprobs=np.full(length, -10.8, np.float32), reward=float(rng.random() < 0.5),
                          done=False, memory_count=0))
    return Trajectory(trajectory_id=f"task-{index}#0", task_id=f"task-{index}", env="arithmetic", sampler_id="synthetic",
                      behaviour_version=0, prompt_ids=rng.integers(3, 49152, 12).astype(np.int32), steps=steps,
                      memory=Memory.empty(SHIPPED_BASIS.width), temperature=1.0, encoder="all-MiniLM-L6-v2",
                      recent_window=0, memory_basis=SHIPPED_BASIS.identity)


def write_config(path: Path, prefix: str, group: str | None = None, trainer_toml: str = "", **trainer) -> None:
    """Tiny-model trainer config on the prefixed topics; `trainer_toml` adds raw lines to [trainer]."""
    knobs = {"batch_size": 3, "checkpoint_every": 1, "max_staleness": 1000, **trainer}
    path.write_text(
        f'[topics]\ntrajectories = "{prefix}.traj"\npolicy = "{prefix}.policy"\ndlq = "{prefix}.dlq"\n'
        f'trainer_group = "{group or prefix + "-trainer"}"\n'
        '[policy]\nmodel = "tiny"\n[metrics]\ntrainer_port = 0\n[trainer]\n'
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in knobs.items()) + trainer_toml + "\n")


def produce_trajectories(bootstrap: str, prefix: str, partitions: int = 3) -> list[str]:
    ensure_topics(bootstrap, {f"{prefix}.traj": partitions, f"{prefix}.policy": 1, f"{prefix}.dlq": 1})
    rng = np.random.default_rng(0)
    producer = make_producer(bootstrap)
    trajectories = [synthetic_trajectory(i, rng) for i in range(TOTAL)]
    for t in trajectories:
        producer.produce(f"{prefix}.traj", encode(t), key=t.task_id)
    producer.produce(f"{prefix}.traj", encode(trajectories[0]), key=trajectories[0].task_id)  # redelivery
    producer.produce(f"{prefix}.traj", b"\x93not a trajectory", key="garbage")
    assert producer.flush(30) == 0
    return [t.trajectory_id for t in trajectories]


def trainer_command(config: Path, bootstrap: str, run_dir: Path, *extra: str, expect: int = TOTAL + 1,
                    entry: list[str] | None = None) -> list[str]:
    """`sao trainer` (or `entry`, a script standing in for `-m sao.cli`) until `expect` trajectories are handled."""
    return [sys.executable, *(entry or ["-m", "sao.cli"]), "trainer", "--config", str(config), "--bootstrap-servers",
            bootstrap, "--run-dir", str(run_dir), "--expect", str(expect), *extra]


def produce(bootstrap: str, topic: str, trajectories: list[Trajectory]) -> None:
    """Each trajectory keyed by its task id, all acknowledged."""
    producer = make_producer(bootstrap)
    for trajectory in trajectories:
        producer.produce(topic, encode(trajectory), key=trajectory.task_id)
    assert producer.flush(60) == 0


def dead_letters(bootstrap: str, topic: str) -> dict[str, dict]:
    """Dead letters by key (task id)."""
    letters = [describe_dlq_message(m) for m in read_all(bootstrap, topic, timeout=30)]
    by_key = {letter["key"].decode(): letter for letter in letters}
    assert len(by_key) == len(letters), "a message was dead-lettered twice"
    return by_key


def trained_ids(run_dir) -> list[str]:
    """Every id in the ledger, in training order."""
    return [tid for line in (run_dir / "trained.jsonl").read_text().splitlines()
            for tid in json.loads(line).get("trajectory_ids", [])]


def latest_weights_are_finite(run_dir) -> bool:
    """Whether the newest published weights hold only finite numbers."""
    import torch
    from safetensors.torch import load_file

    newest = sorted((run_dir / "policy").glob("policy-v*.safetensors"))[-1]
    return all(bool(torch.isfinite(tensor).all()) for tensor in load_file(newest).values())


def wait_for_step(status: Path, step: int, proc: subprocess.Popen, timeout: float = 150) -> None:
    """Wait until the trainer's progress file says it reached `step`; fail if it exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the trainer exited before it reached the step"
        try:
            if json.loads(status.read_text()).get("step", 0) >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"the trainer did not reach step {step}")


def kill_9_after_step_2_and_resume(config: Path, bootstrap: str, run_dir: Path, log: Path, timeout: float,
                                   max_delay: float = 1.0) -> tuple[float, subprocess.CompletedProcess]:
    """Start the trainer, kill -9 it a seeded random moment (under `max_delay` s) after step 2, resume it to the end.

    Returns the delay it was killed after (a failure names it) and the resumed run. A tiny model's steps are
    short: a test that needs the kill to land before the last step keeps `max_delay` small.
    """
    import os
    import signal

    from support.fault_runs import fault_rng

    first = subprocess.Popen(trainer_command(config, bootstrap, run_dir), stdout=subprocess.DEVNULL,
                             stderr=open(log, "w"))
    wait_for_step(run_dir / "status" / "trainer.json", 2, first)
    delay = fault_rng().uniform(0, max_delay)  # seeded: a failure names its seed and reproduces with it
    time.sleep(delay)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    return delay, subprocess.run(trainer_command(config, bootstrap, run_dir, "--resume"), capture_output=True,
                                 text=True, timeout=timeout)
