"""Runs for fault tests: a config on topics of its own, processes to kill, and `sao audit` to end with."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from sao.config import SaoConfig, to_toml
from sao.run_dir import RunDir
from sao.transport.topics import ensure_topics


def fault_seed() -> int:
    """The seed of a fault test's random choices (e.g. when to kill): SAO_FAULT_SEED, else 0.

    Fixed by default, so a failure reproduces; a failing test names its seed, and SAO_FAULT_SEED=N
    runs it again with that seed (or explores others).
    """
    return int(os.environ.get("SAO_FAULT_SEED", "0"))


def fault_rng() -> random.Random:
    return random.Random(fault_seed())


def on_own_topics(base: SaoConfig, bootstrap: str, prefix: str, partitions: int = 1) -> SaoConfig:
    """A copy of `base` on `bootstrap` whose topics and groups carry `prefix` (created now); metrics ports off."""
    config = base.model_copy(deep=True)
    config.broker.bootstrap_servers = bootstrap
    topics = config.topics
    topics.tasks, topics.trajectories, topics.policy, topics.dlq = (f"{prefix}.tasks", f"{prefix}.traj",
                                                                    f"{prefix}.policy", f"{prefix}.dlq")
    topics.sampler_group, topics.trainer_group = f"{prefix}-samplers", f"{prefix}-trainer"
    config.metrics.sampler_port = config.metrics.trainer_port = 0
    ensure_topics(bootstrap, {topics.tasks: partitions, topics.trajectories: partitions, topics.policy: 1,
                              topics.dlq: 1})
    return config


def write_toml(config: SaoConfig, path: Path) -> Path:
    path.write_text(to_toml(config))
    return path


def sampler_command(config: Path, run_dir: Path, sampler_id: str, *extra: str) -> list[str]:
    """`sao sampler` reading announced weights from `run_dir`'s policy folder."""
    return [sys.executable, "-m", "sao.cli", "sampler", "--config", str(config), "--run-dir", str(run_dir),
            "--sampler-id", sampler_id, *extra]


def audit(config: Path, run_dir: Path, json_path: Path, quiet_s: float = 1.0) -> dict:
    """`sao audit --finished` of the run (a topic is read until quiet for `quiet_s`); its JSON report, with
    the exit code as `exit_code` and the printed table as `table`."""
    result = subprocess.run([sys.executable, "-m", "sao.cli", "audit", "--config", str(config), "--run-dir",
                             str(run_dir), "--finished", "--json", str(json_path), "--quiet-s", str(quiet_s)],
                            capture_output=True, text=True, timeout=300)
    assert json_path.is_file(), result.stdout + result.stderr[-3000:]
    return {**json.loads(json_path.read_text()), "exit_code": result.returncode, "table": result.stdout}


def wait_for(condition, what: str, timeout: float, *processes: subprocess.Popen) -> None:
    """Poll `condition()` until true; fail at once if one of `processes` exits first."""
    deadline = time.monotonic() + timeout
    while not condition():
        for process in processes:
            assert process.poll() is None, f"{' '.join(process.args[2:4])} exited ({process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)


def trainer_status(run_dir: Path) -> dict:
    """The trainer's status file, as it left it."""
    return json.loads(RunDir(run_dir).status("trainer").read_text())
