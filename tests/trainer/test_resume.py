"""Resume after a crash or a stop: every trajectory is trained on, and every bad message dead-lettered, exactly once."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from sao.schema import PolicyAnnouncement, decode
from sao.transport.kafka import make_producer, read_all
from sao.transport.topics import ensure_topics
from support.fault_runs import fault_seed
from support.trainer_runs import (
    TOTAL,
    dead_letters,
    kill_9_after_step_2_and_resume,
    produce,
    produce_trajectories,
    synthetic_trajectory,
    trainer_command,
    wait_for_step,
    write_config,
)


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
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_kill_9_and_resume_trains_every_trajectory_exactly_once(kafka_bootstrap, unique_topic_prefix, tmp_path,
                                                                lora_rank):
    ids = produce_trajectories(kafka_bootstrap, unique_topic_prefix)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, unique_topic_prefix, trainer_toml=f"lora = {{ rank = {lora_rank} }}")
    delay, second = kill_9_after_step_2_and_resume(config, kafka_bootstrap, run_dir, tmp_path / "first.log", 150)
    assert second.returncode == 0, second.stderr[-3000:]
    trained = effective_ledger(run_dir / "trained.jsonl")
    assert sorted(trained) == sorted(ids), (f"killed {delay:.2f} s after step 2 (SAO_FAULT_SEED={fault_seed()}): "
                                          "lost or repeated trajectories")
    assert len(trained) == len(set(trained)) == TOTAL
    state = json.loads((run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
                        / "sao_state.json").read_text())
    assert state["handled"] == TOTAL + 1  # 18 trained + 1 malformed message dead-lettered
    # No version number is announced twice: the resumed trainer continues above the crashed one's.
    announcements = [decode(m.value(), PolicyAnnouncement) for m in read_all(kafka_bootstrap,
                                                                              f"{unique_topic_prefix}.policy")]
    versions = [a.policy_version for a in announcements]
    assert len(versions) == len(set(versions)) and max(versions) == state["policy_version"]
    assert {a.content for a in announcements} == {"lora" if lora_rank else "full"}  # both lives publish alike


@pytest.mark.slow
def test_a_message_dead_lettered_after_the_last_step_is_in_the_final_checkpoint(kafka_bootstrap, unique_topic_prefix,
                                                                              tmp_path):
    """The bad message arrives after the last batch's checkpoint: the stop records it, a resume does not redo it."""
    prefix = unique_topic_prefix
    ensure_topics(kafka_bootstrap, {f"{prefix}.traj": 1, f"{prefix}.policy": 1, f"{prefix}.dlq": 1})
    rng = np.random.default_rng(0)
    produce(kafka_bootstrap, f"{prefix}.traj", [synthetic_trajectory(i, rng) for i in range(TOTAL)])
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, prefix)
    first = subprocess.Popen(trainer_command(config, kafka_bootstrap, run_dir), stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "first.log", "w"))
    wait_for_step(run_dir / "status" / "trainer.json", TOTAL // 3, first)  # every trajectory trained, checkpointed
    producer = make_producer(kafka_bootstrap)
    producer.produce(f"{prefix}.traj", b"\x93not a trajectory", key="garbage")  # offset TOTAL
    assert producer.flush(30) == 0
    assert first.wait(timeout=150) == 0, (tmp_path / "first.log").read_text()[-3000:]

    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((latest / "sao_state.json").read_text())
    assert latest.name == f"step-{TOTAL // 3:08d}"
    assert state["handled"] == TOTAL + 1 and state["offsets"] == {"0": TOTAL + 1}
    # The rewritten state still vouches for the unchanged files: the resume trusts it, and has nothing to redo.
    second = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir, "--resume"), capture_output=True,
                            text=True, timeout=150)
    assert second.returncode == 0, second.stderr[-3000:]
    assert list(dead_letters(kafka_bootstrap, f"{prefix}.dlq")) == ["garbage"]
