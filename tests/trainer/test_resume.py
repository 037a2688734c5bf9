"""kill -9 the trainer at a random moment, resume: every trajectory is trained on exactly once."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sao.schema import PolicyAnnouncement, decode
from sao.transport.kafka import read_all
from support.trainer_runs import TOTAL, produce_trajectories, trainer_command, wait_for_step, write_config


def effective_ledger(path: Path) -> list[str]:
    """Trained ids in the surviving lineage: steps after the checkpoint a resume restarted from are void."""
    steps: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "resumed_from_step" in record:
            steps = {s: ids for s, ids in steps.items() if s <= record["resumed_from_step"]}
        else:
            steps[record["step"]] = record["trajectory_ids"]
    return [tid for s in sorted(steps) for tid in steps[s]]


@pytest.mark.slow
def test_kill_9_and_resume_trains_every_trajectory_exactly_once(kafka_bootstrap, unique_topic_prefix, tmp_path):
    ids = produce_trajectories(kafka_bootstrap, unique_topic_prefix)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, unique_topic_prefix)
    first = subprocess.Popen(trainer_command(config, kafka_bootstrap, run_dir), stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "first.log", "w"))
    wait_for_step(run_dir / "status" / "trainer.json", 2, first)
    delay = random.uniform(0, 1.0)
    time.sleep(delay)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()

    second = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir, "--resume"), capture_output=True,
                            text=True, timeout=150)
    assert second.returncode == 0, second.stderr[-3000:]
    trained = effective_ledger(run_dir / "trained.jsonl")
    assert sorted(trained) == sorted(ids), f"killed after {delay:.2f} s: lost or repeated trajectories"
    assert len(trained) == len(set(trained)) == TOTAL
    state = json.loads((run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
                        / "sao_state.json").read_text())
    assert state["handled"] == TOTAL + 1  # 18 trained + 1 malformed message dead-lettered
    # No version number is announced twice: the resumed trainer continues above the crashed one's.
    versions = [decode(m.value(), PolicyAnnouncement).policy_version
                for m in read_all(kafka_bootstrap, f"{unique_topic_prefix}.policy")]
    assert len(versions) == len(set(versions)) and max(versions) == state["policy_version"]
